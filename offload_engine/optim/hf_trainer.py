"""ZeroMuon in the Hugging Face Trainer, with the Trainer's own learning rate, decay groups
and schedule.

    trainer = Trainer(model=model, args=args, train_dataset=ds,
                      optimizer_cls_and_kwargs=(TrainerZeroMuon(args, store=cfg), {}))

The Trainer calls ``TrainerZeroMuon(...)()`` and then the result with the model (its
"optimizer factory" protocol), after it has wrapped the model, so ZeroMuon sees the
parameters the run trains. No transformers import: only ``TrainingArguments`` attributes
are read.
"""

from __future__ import annotations

from torch import nn


def decay_parameter_names(model: nn.Module) -> set[str]:
    """The Trainer's rule: weight decay on every parameter except biases and the weights of
    normalisation layers (any module whose class name contains "Norm")."""
    names = set()
    for mod_name, module in model.named_modules():
        is_norm = "norm" in type(module).__name__.lower()
        for p_name, _ in module.named_parameters(recurse=False):
            if not is_norm and p_name != "bias":
                names.add(f"{mod_name}.{p_name}" if mod_name else p_name)
    return names


def trainer_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """The Trainer's two groups (decay, no decay) of trainable parameters, as tensors; the
    caller passes ``model=`` to ZeroMuon, which names them and splits Muon from AdamW."""
    decay = decay_parameter_names(model)
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [{"params": [p for n, p in params if n in decay], "weight_decay": weight_decay},
              {"params": [p for n, p in params if n not in decay], "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


class TrainerZeroMuon:
    """An optimizer factory for ``Trainer(optimizer_cls_and_kwargs=(TrainerZeroMuon(args,
    ...), {}))``: builds ZeroMuon from the Trainer's model with ``args.learning_rate`` for
    both halves (Muon with ``adjust_lr_fn="match_rms_adamw"``, so one learning rate suits
    both, as Moonlight does), ``args.weight_decay`` on the Trainer's decay group,
    ``adam_beta1/2`` and ``adam_epsilon`` for AdamW. ``options`` go to ZeroMuon and win
    (``store``, ``master_weights``, ``lr`` for Muon alone, ``adamw``, ...). The Trainer's
    scheduler then drives both halves' learning rates."""

    def __init__(self, args, **options):
        self.args = args
        self.options = options

    def __call__(self, model: nn.Module | None = None, **kwargs):
        if model is None:  # the Trainer instantiates the factory before calling it
            return self
        from .zero_muon import ZeroMuon

        a = self.args
        options = {"lr": a.learning_rate, "adjust_lr_fn": "match_rms_adamw",
                   "weight_decay": a.weight_decay, **self.options, **kwargs}
        adamw = {"lr": a.learning_rate, "betas": (a.adam_beta1, a.adam_beta2),
                 "eps": a.adam_epsilon, "weight_decay": a.weight_decay,
                 **options.pop("adamw", {})}
        return ZeroMuon(trainer_groups(model, a.weight_decay), model=model, adamw=adamw,
                        **options)
