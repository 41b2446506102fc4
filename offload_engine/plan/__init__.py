"""plan layer (see docs/architecture.md)."""
