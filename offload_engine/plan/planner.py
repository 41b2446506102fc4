"""The plan: every rank's bytes per tier, placement, verdicts, traffic and the store config.

``build_plan`` puts memory.py (bytes), placement.py (homes, budgets, verdicts) and
traffic.py (bytes per step, time, endurance) together into one JSON-ready dict (versioned:
``format``/``format_version``); ``smallest_world_size`` searches the world sizes of
``placement.candidate_world_sizes`` for the first whose every tier fits.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..dtypes import FLOAT32
from ..io.align import round_up
from ..store import StoreConfig
from ..store.config import default as store_default
from ..units import MiB
from . import deepspeed_compat
from .memory import (PlanOptions, gathered_unit, RankState, classify, compute_bytes,
                     rank_states, rank_tables, store_metadata_bytes)
from ..optim.param_rules import is_expert_stack
from .moe_shapes import active_params
from .model_shapes import ModelShapes
from .placement import (HOST_PER_RANK, OS_FRACTION, Placement, TierVerdict, binding,
                        candidate_world_sizes, choose, usable_gpu, working_buckets)
from .traffic import drive_writes_per_day, io_seconds, step_io

FORMAT = "offload-engine-plan"
FORMAT_VERSION = 1
DEFAULT_IO = {k: store_default(k) for k in ("block_size", "queue_depth", "io_threads")}
NVME_PLACEHOLDER = "NVME_DIR"


@dataclass
class Machine:
    """The hardware one plans for. Bytes, and GB/s (1e9 bytes per second)."""

    gpu_mem: int = 80 * 10**9
    cpu_mem: int = 1024 * 2**30             # per node
    gpus_per_node: int = 8
    nvme_paths: list[str] = field(default_factory=list)
    nvme_capacity: int | None = None        # bytes free for state, per node
    nvme_drive_bytes: int | None = None     # drive capacity per node, for writes per day
    read_gbps: float | None = None
    write_gbps: float | None = None
    bandwidth_source: str = "none"
    io: dict = field(default_factory=lambda: dict(DEFAULT_IO))
    dwpd_rating: float = 1.0


@dataclass
class Workload:
    """Optional: how long a step takes, for writes per day and the I/O share of a step."""

    step_time_s: float | None = None
    tokens_per_step: int | None = None      # global tokens per optimizer step
    gpu_tflops: float = 989.0               # dense bf16 peak per GPU (H100 SXM)
    mfu: float = 0.4
    activations: int = 0                    # bytes per GPU, not modelled: given by the user
    compute_ranks: int | None = None        # GPUs sharing the model's FLOPs (default: world size;
                                            # a mesh plan covers one shard group of more ranks)


def kinds_for(model: ModelShapes, optimizer: str) -> list[str]:
    """Muon/AdamW per tensor: the optimizer's default rule, or AdamW for everything."""
    if optimizer == "adamw":
        return ["adamw"] * len(model.tensors)
    return classify(model)


def build_plan(model: ModelShapes, opts: PlanOptions, machine: Machine,
               workload: Workload | None = None, *, optimizer: str = "muon", home: str = "auto",
               cpu_budget: int | None = None, search: bool = True,
               kinds: list[str] | None = None) -> dict:
    workload = workload or Workload()
    kinds = kinds or kinds_for(model, optimizer)
    states = rank_states(model, opts, kinds=kinds)
    staging = max(working_buckets(s.layout) for s in states) * opts.bucket_bytes
    host_other = max(sum(compute_bytes(s, model, opts, 0)[1].values()) for s in states)
    place = choose(states, bucket_bytes=opts.bucket_bytes,
                   cpu_mem=machine.cpu_mem, ranks_per_node=opts.ranks_per_node,
                   nvme_available=bool(machine.nvme_paths or machine.nvme_capacity),
                   device=opts.device, home=home, cpu_budget=cpu_budget, staging=staging,
                   host_other=host_other)
    homes = {n: place.home for n in states[0].arrays}
    stripes = [str(p) for p in machine.nvme_paths] or [NVME_PLACEHOLDER]

    meta: dict[int, int] = {}  # store metadata bytes per layout (its ranks differ by digits)
    per_rank = [_rank_bytes(st, model, opts, place, homes, stripes, workload, meta)
                for st in states]
    ios, seen = [], {}
    for st in states:  # ranks with one layout move the same bytes: replay each layout once
        if id(st.layout) not in seen:
            seen[id(st.layout)] = step_io(st, homes, place.cpu_budget, opts.prefetch_depth)
        ios.append(seen[id(st.layout)])

    R = opts.ranks_per_node
    nodes = [list(range(k * R, min((k + 1) * R, opts.world_size))) for k in range(opts.nodes)]
    node = [_node_bytes(per_rank, ios, ranks, machine) for ranks in nodes]
    worst_node = max(range(len(node)), key=lambda k: (node[k]["nvme_bytes"], node[k]["cpu_bytes"]))
    gpu_rank = max(range(len(per_rank)), key=lambda r: (per_rank[r]["gpu"]["total"], -r))

    tiers = {
        "gpu": TierVerdict(per_rank[gpu_rank]["gpu"]["total"],
                           usable_gpu(machine.gpu_mem) if opts.gpu else None),
        "cpu": TierVerdict(max(n["cpu_bytes"] for n in node), int(machine.cpu_mem * (1 - OS_FRACTION))),
        "nvme": TierVerdict(max(n["nvme_bytes"] for n in node),
                            machine.nvme_capacity if place.home == "nvme" else None),
    }
    if place.home == "nvme" and machine.nvme_capacity is None:
        tiers["nvme"] = TierVerdict(tiers["nvme"].used, None)
    fits = all(v.fits is not False for v in tiers.values()) and place.pinnable >= (
        place.working if place.home == "nvme" else place.needed) and not (
        place.home == "nvme" and not (machine.nvme_paths or machine.nvme_capacity))

    # exchanged Muon elements: expert stacks are kept by the ranks holding them whole
    p_muon = sum(t.numel for t, k in zip(model.tensors, kinds)
                 if k == "muon" and not is_expert_stack(t.name, len(t.shape)))
    traffic = _traffic(per_rank, ios, node[worst_node], opts, machine, workload, model, states,
                       p_muon)
    config = emit_config(place, machine, opts)
    doc = {
        "format": FORMAT, "format_version": FORMAT_VERSION,
        "model": _model_summary(model, kinds, states[0], opts),
        "inputs": {"world_size": opts.world_size, "gpus_per_node": R, "nodes": opts.nodes,
                   "gpu_mem_bytes": machine.gpu_mem, "cpu_mem_bytes_per_node": machine.cpu_mem,
                   "nvme_paths": list(machine.nvme_paths),
                   "nvme_capacity_bytes_per_node": machine.nvme_capacity,
                   "optimizer": optimizer, "master_weights": opts.master_weights,
                   "param_dtype": opts.param_dtype.name,
                   "device": opts.device, "gpu": opts.gpu, "bucket_bytes": opts.bucket_bytes,
                   "prefetch_depth": opts.prefetch_depth},
        "per_rank": {**per_rank[gpu_rank], "state": _state_summary(states[gpu_rank], homes)},
        "rank_totals": {"gpu": _spread([p["gpu"]["total"] for p in per_rank]),
                        "cpu": _spread([p["cpu"]["total"] for p in per_rank]),
                        "nvme": _spread([p["nvme"]["total"] for p in per_rank])},
        "per_node": {"node": worst_node, **node[worst_node]},
        "placement": {"default_home": place.home, "cpu_budget": place.cpu_budget,
                      "gpu_budget": place.gpu_budget, "state_pinned_bytes": place.needed,
                      "nvme_working_set_bytes": place.working,
                      "pinnable_bytes_per_rank": place.pinnable, "reason": place.reason,
                      "homes": homes},
        "verdict": {"fits": bool(fits), "tiers": {k: v.as_dict() for k, v in tiers.items()},
                    "binding": binding(tiers), "smallest_world_size": None, "notes": []},
        "traffic": traffic,
        "deepspeed": _deepspeed(model, opts, states, per_rank, node[worst_node], kinds),
        "store_config": config,
    }
    _notes(doc, place, machine, opts, workload)
    if search:
        doc["verdict"]["smallest_world_size"] = smallest_world_size(
            model, opts, machine, workload, optimizer=optimizer, home=home, cpu_budget=cpu_budget,
            kinds=kinds, known={opts.world_size: fits})
    return doc


def smallest_world_size(model, opts: PlanOptions, machine: Machine, workload=None, *,
                        optimizer="muon", home="auto", cpu_budget=None, kinds=None,
                        known: dict | None = None, limit: int = 8192,
                        max_evaluations: int = 8) -> int | None:
    """The smallest candidate world size (same machine, same GPUs per node) that fits.

    Candidates whose cheap lower bounds already fail are skipped (parameters and gradients
    per GPU, the largest gathered unit and Newton-Schulz workspace, every rank's host
    memory, the state per node); the first ``max_evaluations`` that pass are planned in
    full. None: nothing up to ``limit`` ranks (or within those evaluations) fits.
    """
    kinds = kinds or kinds_for(model, optimizer)
    p = opts.param_dtype.itemsize
    n_all = model.numel
    unit = gathered_unit(model, min(opts.expert_parallel, opts.world_size))
    # the largest matrix Newton-Schulz sees: a 2-D parameter, or one expert of a stack
    mats = [t.shape[-2:] for t, k in zip(model.tensors, kinds) if k == "muon"]
    big = max(mats, key=lambda s: s[0] * s[1], default=None)
    ns_min = 0 if big is None else 4 * big[0] * big[1] + 4 * min(big) ** 2
    sb = 4 if opts.master_weights and opts.param_dtype != FLOAT32 else p
    state = sum(t.numel * (sb if k == "muon" else 2 * sb) for t, k in zip(model.tensors, kinds))
    if opts.master_weights and opts.param_dtype != FLOAT32:
        state += 4 * n_all
    cpu_cap = machine.cpu_mem * (1 - OS_FRACTION)
    gpu_cap = usable_gpu(machine.gpu_mem)
    nvme_ok = bool(machine.nvme_paths or machine.nvme_capacity)
    evaluations = 0
    for w in candidate_world_sizes(machine.gpus_per_node, limit):
        if known and w in known:
            if known[w]:
                return w
            continue
        r = min(machine.gpus_per_node, w)
        host = HOST_PER_RANK + (2 * p * n_all / w if opts.device != "cuda" else 0)
        if r * host > cpu_cap:
            if w >= machine.gpus_per_node and opts.device == "cuda":
                return None  # a full node's processes alone do not fit its memory
            continue
        if opts.gpu:
            on_gpu = 2 * unit * p if (w > 1 or opts.device != "cuda") else 0
            if opts.device == "cuda":
                on_gpu += 2 * p * n_all / w + ns_min
            if on_gpu > gpu_cap:
                continue
        if not nvme_ok and r * (host + state / w) > cpu_cap:
            continue
        if machine.nvme_capacity is not None and r * state / w > machine.nvme_capacity \
                and r * (host + state / w) > cpu_cap:
            continue
        if evaluations >= max_evaluations:
            return None
        evaluations += 1
        o = PlanOptions(**{**opts.__dict__, "world_size": w})
        doc = build_plan(model, o, machine, workload, optimizer=optimizer, home=home,
                         cpu_budget=cpu_budget, search=False, kinds=kinds)
        if doc["verdict"]["fits"]:
            return w
    return None


def emit_config(place: Placement, machine: Machine, opts: PlanOptions) -> dict:
    """A store config ZeroMuon accepts as it is (validated by StoreConfig)."""
    cfg = {"nvme_paths": [str(p) for p in machine.nvme_paths] if place.home == "nvme" else [],
           "cpu_budget": place.cpu_budget, "gpu_budget": place.gpu_budget,
           "bucket_bytes": opts.bucket_bytes,
           "io_threads": int(machine.io["io_threads"]), "queue_depth": int(machine.io["queue_depth"]),
           "block_size": int(min(machine.io["block_size"], opts.bucket_bytes)),
           "prefetch_depth": opts.prefetch_depth, "alternate_order": True,
           "default_home": place.home}
    if place.home == "nvme" and not cfg["nvme_paths"]:
        cfg["nvme_paths"] = [NVME_PLACEHOLDER]
    StoreConfig.load(cfg, source="emitted store config")  # raises if it would not validate
    return cfg


# ----------------------------------------------------------------------------------------------
def _rank_bytes(st: RankState, model, opts, place: Placement, homes, stripes, workload,
                meta_cache: dict) -> dict:
    gpu, host = compute_bytes(st, model, opts, place.gpu_budget, workload.activations)
    nvme_arrays = [a for n, a in st.arrays.items() if homes[n] == "nvme"]
    pool = round_up(place.cpu_budget)
    on_cpu = sum(a.pinned_bytes for n, a in st.arrays.items() if homes[n] == "cpu")
    cpu = {"pinned_pool": pool, "state_homed_on_cpu": on_cpu,
           "nvme_cache_and_working_room": pool - on_cpu,
           "host_process_estimate": HOST_PER_RANK,
           **{f"host_{k}": v for k, v in host.items()}}
    cpu_total = pool + HOST_PER_RANK + sum(host.values())
    files = sum(a.file_bytes for a in nvme_arrays)
    meta = 0
    if nvme_arrays:
        if id(st.layout) not in meta_cache:
            meta_cache[id(st.layout)] = (
                sum(a.metadata_bytes() for a in nvme_arrays)
                + store_metadata_bytes(nvme_arrays, stripes, rank_tables(st, opts.world_size)))
        meta = meta_cache[id(st.layout)]
    return {"rank": st.rank,
            "gpu": {**gpu, "total": sum(gpu.values())},
            "cpu": {**cpu, "total": cpu_total},
            "nvme": {"chunk_files": files, "metadata": meta, "total": files + meta}}


def _node_bytes(per_rank, ios, ranks, machine) -> dict:
    return {"ranks": len(ranks),
            "gpu_bytes": sum(per_rank[r]["gpu"]["total"] for r in ranks),
            "cpu_bytes": sum(per_rank[r]["cpu"]["total"] for r in ranks),
            "pinned_bytes": sum(per_rank[r]["cpu"]["pinned_pool"] for r in ranks),
            "nvme_bytes": sum(per_rank[r]["nvme"]["total"] for r in ranks),
            "nvme_read_bytes_per_step": [sum(ios[r].read[i] for r in ranks) for i in (0, 1)],
            "nvme_written_bytes_per_step": [sum(ios[r].written[i] for r in ranks) for i in (0, 1)]}


def _traffic(per_rank, ios, node, opts, machine: Machine, workload: Workload, model, states,
             p_muon: int) -> dict:
    r0 = ios[0]
    rd = node["nvme_read_bytes_per_step"]
    wr = node["nvme_written_bytes_per_step"]
    bw_r = machine.read_gbps * 1e9 if machine.read_gbps else None
    bw_w = machine.write_gbps * 1e9 if machine.write_gbps else None
    t_io = [io_seconds(rd[i], wr[i], bw_r, bw_w) for i in (0, 1)]
    t_io_mean = None if t_io[0] is None else (t_io[0] + t_io[1]) / 2
    t_comp = None
    if workload.tokens_per_step:
        # a token meets its active parameters only (all of them in a dense model)
        t_comp = 6 * active_params(model.tensors, model.moe) * workload.tokens_per_step / (
            (workload.compute_ranks or opts.world_size) * workload.gpu_tflops * 1e12 * workload.mfu)
    step_s, step_source = workload.step_time_s, "given"
    if step_s is None and t_comp is not None:
        step_s, step_source = t_comp + (t_io_mean or 0.0), "compute model + optimizer I/O"
    if step_s is None and t_io_mean:
        step_s, step_source = t_io_mean, "optimizer I/O alone (upper bound on writes per day)"
    written_mean = (wr[0] + wr[1]) / 2
    dwpd = drive_writes_per_day(written_mean, step_s, machine.nvme_drive_bytes)
    a2a_sent = max(s.a2a_sent for s in states)
    return {
        "nvme_read_bytes_per_step_per_rank": list(r0.read),
        "nvme_written_bytes_per_step_per_rank": list(r0.written),
        "nvme_state_bytes_per_rank": r0.nvme_state,
        "nvme_resident_bytes_at_step_start_per_rank": list(r0.resident),
        "nvme_read_bytes_per_step_per_node": rd,
        "nvme_written_bytes_per_step_per_node": wr,
        "bandwidth": {"read_gbps": machine.read_gbps, "write_gbps": machine.write_gbps,
                      "source": machine.bandwidth_source},
        "io_time_s_per_step": t_io, "io_time_s_mean": t_io_mean,
        "compute_time_s_per_step": t_comp,
        "step_time_s": step_s, "step_time_source": step_source if step_s else None,
        "all_to_all_bytes_per_step_per_rank": {
            "sent": a2a_sent, "received": max(s.a2a_received for s in states),
            "calls": max(s.a2a_calls for s in states),
            "design_formula": int(4 * (opts.world_size - 1) / opts.world_size * p_muon
                                  / opts.world_size)},
        "newton_schulz_flops_per_step_per_rank": {
            "max": max(s.ns_flops for s in states),
            "mean": sum(s.ns_flops for s in states) // len(states)},
        "drive_writes_per_day": None if dwpd is None else round(dwpd, 3),
        "dwpd_rating": machine.dwpd_rating,
        "endurance_ok": None if dwpd is None else dwpd <= machine.dwpd_rating,
        "drive_bytes_per_node": machine.nvme_drive_bytes,
    }


def _model_summary(model: ModelShapes, kinds, st: RankState, opts: PlanOptions) -> dict:
    muon = sum(t.numel for t, k in zip(model.tensors, kinds) if k == "muon")
    total = model.numel
    state_bytes = sum(a.nbytes for a in st.arrays.values()) * opts.world_size
    units = model.units()
    return {"name": model.name, "family": model.family, "source": model.source,
            "tensors": len(model.tensors), "params": total, "params_muon": muon,
            "params_adamw": total - muon, "muon_fraction": round(muon / total, 6) if total else 0.0,
            "tied_embeddings": model.tied_embeddings,
            "largest_layer_params": model.largest_layer(),
            "largest_fsdp_unit_params": max(units.values(), default=0),
            "state_bytes_per_param": round(state_bytes / total, 4) if total else 0.0,
            "moe": _moe_summary(model),
            "notes": list(model.notes)}


def _moe_summary(model: ModelShapes) -> dict | None:
    """Experts per MoE layer, experts per token, and the parameters a token uses (active)."""
    if model.moe is None:
        return None
    stacks = [t for t in model.tensors if is_expert_stack(t.name, len(t.shape))]
    return {"experts": model.moe.experts, "experts_per_token": model.moe.top_k,
            "moe_layers": model.moe.moe_layers, "shared_experts": model.moe.shared_experts,
            "hidden_size": model.moe.hidden,
            "expert_stacks": len(stacks), "params_routed_experts": sum(t.numel for t in stacks),
            "params_active": active_params(model.tensors, model.moe)}


def _state_summary(st: RankState, homes) -> dict:
    by_kind: dict[str, dict] = {}
    logical: dict[str, int] = {}
    for c in st.layout.bundles:
        for name in c.arrays:
            logical[name] = logical.get(name, 0) + c.local_numel
    arrays = {}
    for name, a in st.arrays.items():
        arrays[name] = {"dtype": a.dtype.name, "numel": a.numel,
                        "bytes": a.nbytes, "logical_bytes": logical.get(name, 0) * a.itemsize,
                        "buckets": len(a.buckets()), "home": homes[name]}
        k = by_kind.setdefault(a.kind, {"bytes": 0, "logical_bytes": 0})
        k["bytes"] += a.nbytes
        k["logical_bytes"] += logical.get(name, 0) * a.itemsize
    padded = sum(a["bytes"] for a in arrays.values())
    used = sum(a["logical_bytes"] for a in arrays.values())
    return {"arrays": arrays, "by_kind": by_kind, "bytes": padded, "logical_bytes": used,
            "padding_bytes": padded - used,
            "params_local": st.local_numel, "params_local_muon": st.local_muon,
            "params_local_adamw": st.local_adamw}


def _spread(values: list[int]) -> dict:
    return {"min": min(values), "max": max(values)}


def _deepspeed(model, opts, states, per_rank, node, kinds) -> dict:
    P, L = model.numel, model.largest_layer()
    out = {"total_params": P, "largest_layer_params": L,
           "zero3": deepspeed_compat.table(P, L, opts.ranks_per_node, opts.nodes)}
    if all(k == "adamw" for k in kinds):
        st = states[0]
        node_state = sum(c.local_numel * s.arrays[n].itemsize for s in states[:opts.ranks_per_node]
                         for c in s.layout.bundles for n in c.arrays)
        node_padded = sum(a.nbytes for s in states[:opts.ranks_per_node] for a in s.arrays.values())
        p = opts.param_dtype.itemsize
        out["adamw_comparison"] = deepspeed_compat.ours_vs_deepspeed(
            P, L, opts.ranks_per_node, opts.nodes, node_state, 2 * p * st.local_numel,
            2 * p * max(model.units().values(), default=0))
        out["adamw_comparison"]["ours_state_bytes_per_node_with_padding"] = node_padded
    return out


def _notes(doc, place: Placement, machine: Machine, opts: PlanOptions, workload) -> None:
    notes = doc["verdict"]["notes"]
    if place.home == "nvme" and not machine.nvme_paths and not machine.nvme_capacity:
        notes.append("the state needs NVMe but none was given (--nvme PATH or --nvme-capacity)")
    if place.home == "nvme" and place.cpu_budget > place.pinnable:
        notes.append(f"the pinned pool a rank needs ({place.cpu_budget} B) exceeds what it can "
                     f"pin ({place.pinnable} B)")
    if place.home == "nvme" and not machine.nvme_paths:
        notes.append(f"store_config.nvme_paths is a placeholder ({NVME_PLACEHOLDER}): put the "
                     "NVMe directory there")
    if machine.read_gbps is None and place.home == "nvme":
        notes.append("no measured bandwidth: run `offload-engine bench disk --path DIR` on the "
                     "NVMe, then plan with --nvme DIR")
    st = doc["per_rank"]["state"]
    if st["logical_bytes"] and st["padding_bytes"] > 0.05 * st["logical_bytes"]:
        notes.append(f"bucket padding: {st['padding_bytes']} B of the {st['bytes']} B of state "
                     f"per rank ({100 * st['padding_bytes'] / st['bytes']:.0f}%) are padding (where "
                     "a bundle's arrays disagree on the position inside a bucket they start on a "
                     "boundary) and are stored and moved too; another --bucket-bytes may pad less")
    if opts.gpu and not workload.activations:
        notes.append("activations are not modelled: the GPU figure is model state, buffers and "
                     "the store's staging arena (add --activations BYTES)")
