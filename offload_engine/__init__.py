"""offload-engine: a tiered optimizer-state store (GPU / pinned CPU / NVMe), a ZeRO-3 Muon
optimizer on FSDP2, and offline checkpoint tools. See DESIGN in docs/architecture.md."""

__version__ = "0.1.0"
