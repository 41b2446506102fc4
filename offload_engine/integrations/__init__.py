"""Adapters that let other training frameworks drive ZeroMuon without glue code.

Each module here imports its framework when imported itself, so ``import offload_engine``
never needs any of them installed: ``offload_engine.integrations.torchtitan`` needs
torchtitan (docs/torchtitan.md), ``offload_engine.integrations.hf_trainer`` (the Hugging
Face Trainer saving and resuming through our checkpoints) transformers and accelerate
(docs/optimizer.md).
"""
