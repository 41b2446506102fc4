"""The random number generators a training step draws from, per rank: Python's ``random``,
numpy's global generator (where numpy is installed), torch's CPU generator and, where CUDA
is available, the generator of the process's current CUDA device (one device per rank, as
FSDP2 runs are laid out; reading every device's would create a CUDA context on each). Captured when a checkpoint is saved and set
back when it is loaded, so dropout, random augmentation and shuffling continue the same
sequence as a run that never stopped.

The states go through ``safe_state`` (JSON, no pickle).
"""

from __future__ import annotations

import logging
import random

import torch
from ..errors import InputError

log = logging.getLogger(__name__)


def capture_rng() -> dict:
    """This process's generator states now: ``{"python", "numpy", "torch", "cuda"}``
    (numpy and cuda only where present; cuda: the current device's)."""
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    np = _numpy()
    if np is not None:
        state["numpy"] = np.random.get_state()
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def restore_rng(state: dict, where: str) -> None:
    """Set this process's generators to ``state`` (``capture_rng``'s, decoded). A generator
    the checkpoint has no state for (numpy saved without numpy, CUDA saved on a machine
    without it) keeps its own, with a warning naming ``where``; a state of the wrong form
    is a ValueError naming ``where``."""
    try:
        random.setstate(state["python"])
        torch.set_rng_state(state["torch"])
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        raise InputError(f"{where}: the saved Python or torch RNG state cannot be restored "
                         f"({type(e).__name__}: {e})") from None
    np = _numpy()
    if np is not None:
        if "numpy" in state:
            try:
                np.random.set_state(state["numpy"])
            except (TypeError, ValueError) as e:
                raise InputError(f"{where}: the saved numpy RNG state cannot be restored "
                                 f"({e})") from None
        else:
            log.warning("%s: no numpy RNG state was saved; numpy's generator is left as it is",
                        where)
    if torch.cuda.is_available():
        saved = state.get("cuda")
        if saved is None:
            log.warning("%s: saved without CUDA: the CUDA generator is left as it is", where)
        else:
            try:
                torch.cuda.set_rng_state(saved)
            except (TypeError, RuntimeError) as e:
                raise InputError(f"{where}: the saved CUDA RNG state cannot be restored "
                                 f"({e})") from None


def _numpy():
    try:
        import numpy
    except ImportError:
        return None
    return numpy
