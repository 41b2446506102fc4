"""optim layer (see docs/architecture.md)."""
