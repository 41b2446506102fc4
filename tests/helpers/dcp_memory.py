"""Peak memory of dcp.save / dcp.load of a ZeroMuon state, run as its own process.

``python dcp_memory.py DIR [DEVICE]`` builds a model of N equal Muon matrices (the state is N times
the largest parameter's), takes a step, then dcp.saves (torchtitan's flattened flow, see
dcp_flow.py) and dcp.loads into a second optimizer that has taken a step too (so torch's
helpers do not run their zero-gradient step, which allocates a gradient per parameter).
Prints JSON: the growth of this process's peak RSS (VmHWM, reset through
/proc/self/clear_refs before each call) over its RSS before the call, in bytes, for a
save of the optimizer's state alone (``state_save_growth``), for the save of model and
state (``save_growth``: on CUDA it includes DCP's host copy of every parameter) and for the
load, and the state's size in bytes. DEVICE (default cpu) is where the model lives: on "cuda" the growth
is still the host's (DCP's writer stages CUDA tensors in host memory; ours must not all at
once), which tools/gpu_check.py measures.
"""

from __future__ import annotations

import json
import os
import sys

import torch
from torch import nn

MATRICES, ROWS = 32, 512  # 32 matrices of 1 MiB (fp32): 32 MiB of momentum


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def _growth(fn) -> int:
    """Peak RSS during ``fn()`` minus the RSS before it, in bytes."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS
    before = _status("VmRSS")
    fn()
    return _status("VmHWM") - before


def _model(device: str = "cpu") -> nn.Module:
    m = nn.Module()
    g = torch.Generator().manual_seed(0)
    for i in range(MATRICES):
        m.register_parameter(f"w{i}", nn.Parameter(torch.randn(ROWS, ROWS, generator=g).to(device)))
    return m


def _stepped(model, seed: int = 0):
    from offload_engine.optim import ZeroMuon
    opt = ZeroMuon(model.named_parameters(), lr=0.02)
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g).to(p.device)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return opt


def main(path: str, device: str = "cpu") -> None:
    from helpers import dcp_flow
    torch.set_num_threads(1)
    model, model2 = _model(device), _model(device)
    opt, opt2 = _stepped(model, 1), _stepped(model2, 2)  # different states: the load shows
    # DCP's own first-call costs (imports, planner set-up) are not the state's
    tiny = nn.Linear(2, 2).to(device)
    dcp_flow.save(os.path.join(path, "warm"), tiny, _stepped(tiny), True)
    state_bytes = MATRICES * ROWS * ROWS * 4
    # the optimizer's state saved alone, before anything else is staged: on CUDA, DCP's
    # writer also stages every model parameter in host memory (torch's doing, as large as
    # the parameters), and host memory it kept from that would hide the state's own growth
    import torch.distributed.checkpoint as dcp
    state_save = _growth(lambda: dcp.save(
        {"optimizer": dcp_flow.OptimizerState(model, opt, True)},
        checkpoint_id=os.path.join(path, "state-only")))
    save = _growth(lambda: dcp_flow.save(os.path.join(path, "ck"), model, opt, True))
    differ = not torch.equal(opt.state_dict()["state"][0]["momentum_buffer"],
                             opt2.state_dict()["state"][0]["momentum_buffer"])
    load = _growth(lambda: dcp_flow.load(os.path.join(path, "ck"), model2, opt2, True))
    same = all(torch.equal(a["momentum_buffer"], b["momentum_buffer"])
               for a, b in zip(opt.state_dict()["state"].values(),
                               opt2.state_dict()["state"].values()))
    print(json.dumps({"device": device, "save_growth": save, "state_save_growth": state_save,
                      "load_growth": load, "state_bytes": state_bytes,
                      "largest_param_state_bytes": ROWS * ROWS * 4, "differed_before": differ, "loaded_equal": same}))


if __name__ == "__main__":
    main(*sys.argv[1:3])
