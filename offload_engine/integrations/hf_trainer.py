"""The Hugging Face Trainer saving and resuming ZeroMuon through our checkpoints, so a run
whose model is sharded with FSDP2 before the Trainer sees it (by hand, or by
``from_pretrained(distributed_config=...)``) saves, resumes bit for bit and consolidates
(docs/optimizer.md, "accelerate launch").

    trainer = ZeroMuonTrainer(model=model, args=args, train_dataset=ds)
    trainer.train(resume_from_checkpoint=...)   # a checkpoint-<step> folder, or True

Each ``checkpoint-<step>`` folder the Trainer writes is also one of our checkpoint folders:
``save_checkpoint`` writes generation ``step-<step>`` and ``latest`` in it (parameters,
ZeroMuon's state, frozen parameters, buffers; every rank its shards), beside the Trainer's
own files (``trainer_state.json``, ``scheduler.pt``, ``rng_state_<rank>.pth``, the model's
weights). ``offload-engine consolidate <output_dir>/checkpoint-<step> OUT`` then gives
safetensors and the ``config.json`` that ``from_pretrained(OUT)`` loads.

Why a Trainer subclass rather than a callback: a callback sees no resume (the Trainer never
passes ``resume_from_checkpoint`` to one), and the Trainer itself refuses to save optimizer
state for a model sharded before it (transformers 5.25, ``Trainer.__init__``: "Resuming is
not supported for models sharded at load time (`DistributedConfig`), so their optimizer
state cannot be checkpointed"), because its own optimizer save (``torch.save`` of
``optimizer.state_dict()`` on rank 0) cannot hold sharded state. Ours can, so this class
lifts that refusal and replaces the Trainer's optimizer save and load hooks.
"""

from __future__ import annotations

import contextlib
import os
import shutil

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor
from transformers import Trainer
from transformers.trainer import SCHEDULER_NAME
from transformers.trainer_utils import SaveStrategy

from ..checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from ..io.errors import FileIOError
from ..layout.checkpoint_names import LATEST, deleting_path, read_latest
from ..optim.hf_trainer import TrainerZeroMuon


def holds_zero_muon_checkpoint(folder: str) -> bool:
    """Whether the Trainer checkpoint ``folder`` holds one of ours (a ``latest`` file that
    ``save_checkpoint`` wrote), rather than only the Trainer's ``optimizer.pt``."""
    return os.path.isfile(os.path.join(folder, LATEST))


def forget_earlier_save(folder: str) -> None:
    """Remove the generation ``latest`` names in the Trainer checkpoint ``folder``, and
    ``latest``, before the Trainer saves into that folder again: a run resumed from an
    earlier checkpoint into the same ``output_dir`` saves the later steps again, and the
    Trainer overwrites its own files there, so ours go too (``save_checkpoint`` refuses a
    step that is already committed). Rank 0 only; ``latest`` first, so a crash halfway
    leaves nothing that names a part-deleted generation."""
    latest = os.path.join(folder, LATEST)
    if not os.path.isfile(latest):
        return
    generation = os.path.join(folder, read_latest(folder, CheckpointError))
    where = ("remove", latest)
    try:
        os.remove(latest)
        if os.path.isdir(generation):
            where = ("rename", generation)
            os.rename(generation, deleting_path(generation))
            where = ("remove", deleting_path(generation))
            shutil.rmtree(deleting_path(generation))
    except OSError as e:
        raise FileIOError(e.errno, *where, detail=f"{e.strerror} (removing the ZeroMuon "
                          f"checkpoint an earlier run saved in {folder})") from e


def sharded_by_hand(model) -> bool:
    """Whether ``model`` holds DTensor parameters that transformers did not shard itself (no
    ``config.distributed_config``): ``fully_shard`` applied by the user."""
    config = getattr(model, "config", None)
    return (getattr(config, "distributed_config", None) is None
            and any(isinstance(p, DTensor) for p in model.parameters()))


@contextlib.contextmanager
def _optimizer_saved_by_us(model, args):
    """Lift the Trainer's refusal to checkpoint a model sharded at load time while its
    ``__init__`` runs: it reads ``args.save_only_model`` there (the refusal, and two checks
    for accelerate's own FSDP and DeepSpeed, which such a model does not use) and in
    ``_save_checkpoint``, where it must be the user's value again."""
    lift = (args is not None and getattr(model, "is_distributed_loading_by_transformers", False)
            and args.save_strategy != SaveStrategy.NO and not args.save_only_model)
    if lift:
        args.save_only_model = True
    try:
        yield
    finally:
        if lift:
            args.save_only_model = False


class ZeroMuonCheckpointing:
    """Mixin for a Trainer class (``class MyTrainer(ZeroMuonCheckpointing, SFTTrainer)``):
    ZeroMuon by default (``TrainerZeroMuon(args)`` when neither ``optimizers`` nor
    ``optimizer_cls_and_kwargs`` is given), its state saved with ``save_checkpoint`` into each
    Trainer checkpoint folder and restored from it with ``load_checkpoint`` on resume. The
    learning-rate schedule, RNG states and trainer state stay the Trainer's own files."""

    def __init__(self, model=None, args=None, *rest, **kwargs):
        if (not rest and kwargs.get("optimizers", (None, None))[0] is None
                and kwargs.get("optimizer_cls_and_kwargs") is None and args is not None):
            kwargs["optimizer_cls_and_kwargs"] = (TrainerZeroMuon(args), {})
        with _optimizer_saved_by_us(model, args):
            super().__init__(model, args, *rest, **kwargs)

    def _zero_muon(self):
        """The ZeroMuon under accelerate's optimizer wrapper."""
        return getattr(self.optimizer, "optimizer", self.optimizer)

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        if state_dict is None and sharded_by_hand(self.model):
            # save_pretrained gathers FSDP2 shards only for a model that from_pretrained(
            # distributed_config=...) sharded (DistributedMixin.gather_sharded_state_dict_for_save);
            # gather those sharded by hand the same way: whole tensors on rank 0, {} elsewhere
            state_dict = get_model_state_dict(self.model, options=StateDictOptions(
                full_state_dict=True, cpu_offload=True))
        super()._save(output_dir, state_dict)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        distributed = dist.is_available() and dist.is_initialized()
        if not distributed or dist.get_rank() == 0:
            forget_earlier_save(output_dir)
        if distributed:
            dist.barrier()  # no rank looks at the folder before rank 0 has cleared it
        # collective: every rank writes its shards of the state and parameters; the
        # Trainer's RNG files (saved next, per rank) restore RNG, so ours stays off
        save_checkpoint(output_dir, self.model, self._zero_muon(), self.state.global_step,
                        rng=False)
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        # the weights come back with the optimizer state in _load_optimizer_and_scheduler,
        # which every resume calls next: reading them here too would read them twice
        if not holds_zero_muon_checkpoint(resume_from_checkpoint):
            super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None or not holds_zero_muon_checkpoint(checkpoint):
            return super()._load_optimizer_and_scheduler(checkpoint)
        load_checkpoint(checkpoint, self.model, self._zero_muon(), rng=False)
        scheduler = os.path.join(checkpoint, SCHEDULER_NAME)
        if os.path.isfile(scheduler):
            self.lr_scheduler.load_state_dict(torch.load(scheduler, weights_only=True))


class ZeroMuonTrainer(ZeroMuonCheckpointing, Trainer):
    """``transformers.Trainer`` with ZeroMuon and our checkpoints (``ZeroMuonCheckpointing``)."""
