"""torchtitan's checkpoint flow, without torchtitan: the model and the optimizer wrapped in
Stateful objects whose state_dict() calls get_model_state_dict / get_optimizer_state_dict and
whose load_state_dict() calls set_model_state_dict / set_optimizer_state_dict, handed to
dcp.save / dcp.load as one dict (torchtitan's ModelWrapper and OptimizersContainer, with
``flatten_optimizer_state_dict=True``; ``flatten=False`` gives the nested form)."""

from __future__ import annotations

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict,
                                                     set_model_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.checkpoint.stateful import Stateful


class ModelState(Stateful):
    def __init__(self, model):
        self.model = model

    def state_dict(self):
        return get_model_state_dict(self.model)

    def load_state_dict(self, state_dict):
        set_model_state_dict(self.model, state_dict, options=StateDictOptions(strict=False))


class OptimizerState(Stateful):
    def __init__(self, model, opt, flatten: bool):
        self.model, self.opt = model, opt
        self.options = StateDictOptions(flatten_optimizer_state_dict=flatten)

    def state_dict(self):
        return get_optimizer_state_dict(self.model, self.opt, options=self.options)

    def load_state_dict(self, state_dict):
        set_optimizer_state_dict(self.model, self.opt, optim_state_dict=state_dict,
                                 options=self.options)


def states(model, opt, flatten: bool) -> dict:
    return {"model": ModelState(model), "optimizer": OptimizerState(model, opt, flatten)}


def save(path: str, model, opt, flatten: bool) -> None:
    dcp.save(states(model, opt, flatten), checkpoint_id=path)


def load(path: str, model, opt, flatten: bool) -> None:
    dcp.load(states(model, opt, flatten), checkpoint_id=path)
