"""The end-to-end demo: a small decoder-only transformer trained with FSDP2 + ZeroMuon."""
