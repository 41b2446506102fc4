"""Adapters that let other training frameworks drive ZeroMuon without glue code.

Each module here imports its framework when imported itself, so ``import offload_engine``
never needs any of them installed: ``offload_engine.integrations.torchtitan`` needs
torchtitan (docs/torchtitan.md).
"""
