"""The Python API of ``offload-engine consolidate``, and a drop-in for DeepSpeed's
``deepspeed.utils.zero_to_fp32``: change a script's import line and nothing else.

    from offload_engine.consolidate import get_fp32_state_dict_from_zero_checkpoint
    state_dict = get_fp32_state_dict_from_zero_checkpoint("checkpoints/", tag="global_step14",
                                                          exclude_frozen_parameters=True)

DeepSpeed's names, signatures and outputs: ``offline/zero_to_fp32.py``. Ours, which stream
(memory independent of the model's size) and load into sharded models: ``offline/
state_dict.py``. docs/consolidate.md, "Python API", has the table of both.
"""

from .offline.state_dict import (LazyStateDict, convert_to_safetensors, get_fp32_state_dict,
                                 load_state_dict_from_checkpoint)
from .offline.zero_to_fp32 import (LazyTensor, convert_zero_checkpoint_to_fp32_state_dict,
                                   convert_zero_checkpoint_to_state_dict,
                                   get_fp32_state_dict_from_zero_checkpoint,
                                   load_state_dict_from_zero_checkpoint, to_torch_tensor)

__all__ = ["LazyStateDict", "LazyTensor", "convert_to_safetensors",
           "convert_zero_checkpoint_to_fp32_state_dict", "convert_zero_checkpoint_to_state_dict",
           "get_fp32_state_dict", "get_fp32_state_dict_from_zero_checkpoint",
           "load_state_dict_from_checkpoint", "load_state_dict_from_zero_checkpoint",
           "to_torch_tensor"]
