"""The Python API of ``offload-engine consolidate``: drop-ins for DeepSpeed's zero_to_fp32.

    from offload_engine.consolidate import get_fp32_state_dict
    state_dict = get_fp32_state_dict("checkpoints/")        # ours or DeepSpeed ZeRO-1/2/3

See ``offline/state_dict.py`` and docs/consolidate.md for the table of replacements.
"""

from .offline.state_dict import (LazyStateDict, convert_to_safetensors, get_fp32_state_dict,
                                 load_state_dict_from_checkpoint)

__all__ = ["LazyStateDict", "convert_to_safetensors", "get_fp32_state_dict",
           "load_state_dict_from_checkpoint"]
