"""A 2-D device mesh in the planner: HSDP (replicas x shards) and FSDP + tensor parallel.

ZeroMuon keeps each rank's box of every parameter and its state (docs/optimizer.md, "On
2-D meshes"). What a mesh changes for the plan:

- a rank's state is its box: 1/(dp_shard x tp) of each tensor, the same element count as a
  row block over ``dp_shard x tp`` ranks, so the per-rank and per-node figures are those of
  the 1-D plan over one *shard group* of ``dp_shard x tp`` ranks (bucket rounding aside);
- replicas hold the same state again: R copies over the whole run;
- the Muon exchange moves, for W = R x S x T ranks and D = S x T distinct boxes per matrix,
  ``2 P_muon (W + D - 2) / (W D)`` bytes each way per rank and step (the closed form of
  docs/optimizer.md, for shapes that split evenly), of which ``2 (R - 1) P_muon / W`` cross
  between replicas;
- Newton-Schulz runs once per matrix, split over all W ranks, replicas included.

Expert parallelism (``ep``, mixture-of-experts models): as in torchtitan, the ep ranks are
taken from the shard group (``ep`` divides ``dp_shard x tp``; it adds no ranks). Each expert
stack is ``Shard(0)`` on its expert dimension over the ep ranks and again over the
``dp_shard x tp / ep`` ranks of its expert-data-parallel group, so a rank holds
``1/(dp_shard x tp)`` of every stack as whole experts, exactly as FSDP2's ``Shard(0)`` over the
shard group gives it. What ep changes:

- FSDP2 gathers an MoE block's experts only over the expert-data-parallel group: the
  block's ``E / ep`` local experts, not all E;
- ZeroMuon keeps every expert where it is (a rank holds it whole): experts add no Muon
  exchange, and each replica orthogonalizes its own copy (their Newton-Schulz work is split
  over the shard group, not over all W ranks);
- tokens travel to their experts: per MoE layer and step, each rank sends ``tokens x top_k x
  hidden`` bf16 values to the experts of other ep ranks (``(ep - 1)/ep`` of them) and gets
  the results back, forward and backward: ``4 x tokens x top_k x hidden x 2 B x (ep - 1)/ep``
  each way (given ``--tokens-per-step``, spread evenly over the data-parallel ranks).

A shard group must fill whole nodes (the usual layouts: shard within nodes, replicate
across them; or dp x tp over all ranks): then every node holds ranks of one shard group and
the per-node figures are exact for every node.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from ..optim.owners import shape_ns_flops
from ..errors import InputError
from ..jsonlimits import parse_json, read_bounded
from ..units import MiB

# Bytes of a --mesh file: a whole torchtitan config as JSON is a few KB.
MAX_MESH_BYTES = 1 * MiB
# torchtitan's [parallelism] keys, and the short names --mesh takes
TORCHTITAN_KEYS = {"data_parallel_replicate_degree": "dp_replicate",
                   "data_parallel_shard_degree": "dp_shard",
                   "tensor_parallel_degree": "tp",
                   "expert_parallel_degree": "ep"}
AXES = ("dp_replicate", "dp_shard", "tp", "ep")


@dataclass(frozen=True)
class Mesh:
    """Degrees of the mesh: replicas (HSDP), shards (FSDP), tensor-parallel ranks, and the
    expert-parallel ranks taken from the shard group (``ep`` adds no ranks)."""

    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    ep: int = 1

    @property
    def world_size(self) -> int:
        return self.dp_replicate * self.dp_shard * self.tp

    @property
    def shard_group(self) -> int:
        """Ranks holding distinct boxes of each tensor: dp_shard x tp."""
        return self.dp_shard * self.tp


def parse_mesh(text: str, world_size: int | None = None) -> Mesh:
    """``dp_replicate=8,dp_shard=8,tp=4`` (missing axes are 1), a torchtitan parallelism
    block as JSON (``{"data_parallel_shard_degree": -1, "tensor_parallel_degree": 8}``), or
    a file holding that JSON (a whole torchtitan config's ``parallelism`` section is found).
    A degree of -1 is "the rest of ``world_size``", as in torchtitan."""
    source = text
    if os.path.isfile(text):  # strict JSON of at most MAX_MESH_BYTES (docs/untrusted-input.md)
        text = read_bounded(text, MAX_MESH_BYTES, what="--mesh file").decode("utf-8", "replace")
    text = text.strip()
    if text.startswith("{"):
        block = parse_json(text, f"--mesh {source}")
        block = block.get("parallelism", block) if isinstance(block, dict) else block
        if not isinstance(block, dict):
            raise InputError(f"--mesh {source}: expected a JSON object of parallelism degrees")
        degrees = {TORCHTITAN_KEYS[k]: v for k, v in block.items() if k in TORCHTITAN_KEYS}
        others = sorted(k for k, v in block.items()
                        if k not in TORCHTITAN_KEYS and k.endswith("_degree") and v not in (1, None))
        if others:
            raise InputError(f"--mesh {source}: the planner models dp_replicate, dp_shard, tp "
                             f"and ep only, not {', '.join(others)}")
    else:
        degrees = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            key, eq, value = part.partition("=")
            if not eq or key.strip() not in AXES:
                raise InputError(f"--mesh {source}: expected AXIS=N with AXIS one of "
                                 f"{', '.join(AXES)}, got {part!r}")
            try:
                degrees[key.strip()] = int(value)
            except ValueError:
                raise InputError(f"--mesh {source}: {key.strip()} must be an integer, got "
                                 f"{value!r}") from None
    return _resolve(degrees, world_size, source)


def _resolve(degrees: dict, world_size: int | None, source: str) -> Mesh:
    for k, v in degrees.items():
        if not isinstance(v, int) or isinstance(v, bool) or not (v >= 1 or v == -1):
            raise InputError(f"--mesh {source}: {k} must be a positive integer or -1, got {v!r}")
    if degrees.get("ep") == -1:
        raise InputError(f"--mesh {source}: ep cannot be -1 (it is taken from dp_shard x tp, "
                         "not added to the world size)")
    rest = [k for k, v in degrees.items() if v == -1]
    if len(rest) > 1:
        raise InputError(f"--mesh {source}: only one degree may be -1")
    if rest:
        known = math.prod(v for k, v in degrees.items() if v != -1 and k != "ep")
        if world_size is None or world_size % known:
            raise InputError(f"--mesh {source}: {rest[0]} = -1 needs --world-size, a multiple "
                             f"of the other degrees ({known})")
        degrees[rest[0]] = world_size // known
    mesh = Mesh(**degrees)
    if world_size is not None and mesh.world_size != world_size:
        raise InputError(f"--mesh {source}: the degrees multiply to {mesh.world_size} ranks, "
                         f"but --world-size is {world_size}; leave --world-size out, or set one "
                         f"degree to -1 to take the rest (e.g. dp_shard=-1)")
    if mesh.shard_group % mesh.ep:
        fits = [d for d in range(1, mesh.shard_group + 1) if mesh.shard_group % d == 0]
        raise InputError(f"--mesh {source}: ep={mesh.ep} must divide dp_shard x tp = "
                         f"{mesh.shard_group} (expert-parallel ranks are taken from the shard "
                         f"group); ep may be one of {', '.join(map(str, fits[:12]))}"
                         f"{', ...' if len(fits) > 12 else ''}")
    return mesh


def check_nodes(mesh: Mesh, gpus_per_node: int) -> None:
    """A shard group must fill whole nodes (module docstring)."""
    if mesh.world_size % gpus_per_node:
        fits = [g for g in range(1, gpus_per_node + 1) if mesh.world_size % g == 0]
        raise InputError(f"--mesh: {mesh.world_size} ranks do not fill nodes of "
                         f"{gpus_per_node} GPUs; --gpus-per-node {fits[-1]} would, or a world "
                         f"size that is a multiple of {gpus_per_node}")
    if mesh.shard_group % gpus_per_node and mesh.shard_group > 1:
        raise InputError(f"--mesh: a shard group (dp_shard x tp = {mesh.shard_group} ranks) "
                         f"must fill whole nodes of {gpus_per_node} GPUs; the planner does not "
                         f"model nodes holding parts of several shard groups. "
                         f"{_whole_node_meshes(mesh, gpus_per_node)}")


def _whole_node_meshes(mesh: Mesh, gpus_per_node: int) -> str:
    """Meshes of the same world size and tp whose shard groups fill whole nodes."""
    W, T = mesh.world_size, mesh.tp
    options = [f"dp_replicate={W // (s * T)},dp_shard={s},tp={T}"
               for s in range(1, W // T + 1)
               if (W // T) % s == 0 and (s * T) % gpus_per_node == 0]
    if not options:
        return f"No mesh of {W} ranks with tp={T} does."
    return "These would: " + "; ".join(options[:4]) + ("; ..." if len(options) > 4 else "")


def mesh_figures(mesh: Mesh, gpus_per_node: int, muon_shapes: list[tuple[int, ...]],
                 ns_steps: int, node_read: int, node_written: int, state_bytes: int,
                 moe: dict | None = None, tokens_per_step: int | None = None,
                 hidden: int = 0) -> dict:
    """What the mesh adds to a plan made over one shard group: bytes, FLOPs and copies.

    ``muon_shapes``: (rows, cols) of every Muon matrix, (experts, rows, cols) of a stack of
    expert matrices (one Newton-Schulz per expert, kept where it is: no exchange);
    ``node_read``/``node_written``: NVMe bytes per step of the busiest node; ``state_bytes``:
    optimizer-state bytes of one shard group (its ranks' state summed); ``moe``: the plan's
    ``model.moe`` (experts, experts_per_token, moe_layers), ``hidden`` the model's width and
    ``tokens_per_step`` the global batch in tokens, for the expert all_to_all."""
    W, D, R = mesh.world_size, mesh.shard_group, mesh.dp_replicate
    dense = [s for s in muon_shapes if len(s) == 2]
    stacks = [s for s in muon_shapes if len(s) == 3]
    p_muon = sum(math.prod(s) for s in dense)   # exchanged; experts stay where they are
    each_way = 2 * p_muon * (W + D - 2) / (W * D) if W > 1 else 0
    dense_flops = sum(shape_ns_flops(s, ns_steps) for s in dense)
    expert_flops = sum(shape_ns_flops(s, ns_steps) for s in stacks)
    nodes = W // gpus_per_node
    out = {
        "dp_replicate": mesh.dp_replicate, "dp_shard": mesh.dp_shard, "tp": mesh.tp,
        "ep": mesh.ep,
        "world_size": W, "nodes": nodes, "shard_group_ranks": D,
        "nodes_per_shard_group": max(1, D // gpus_per_node),
        "state_copies": R,
        "state_bytes_all_replicas": state_bytes * R,
        "all_to_all_bytes_per_step_per_rank": {
            "each_way": int(each_way),
            "between_replicas": int(2 * (R - 1) * p_muon / W),
            "rule": "2 P_muon (W + D - 2) / (W D) each way; 2 (R - 1) P_muon / W between "
                    "replicas (even shapes, docs/optimizer.md); expert matrices are kept by "
                    "the rank holding them: not exchanged"},
        "newton_schulz_flops_per_step": {
            "total": dense_flops + expert_flops * R,
            "per_rank": dense_flops // W + expert_flops // D,
            "experts_per_rank": expert_flops // D},
        "nvme_bytes_per_step_per_node": {"read": node_read, "written": node_written},
        "nvme_bytes_per_step_all_nodes": {"read": node_read * nodes,
                                          "written": node_written * nodes},
    }
    if moe:
        out["expert_parallel"] = expert_figures(mesh, moe, tokens_per_step, hidden)
    return out


def expert_figures(mesh: Mesh, moe: dict, tokens_per_step: int | None, hidden: int) -> dict:
    """Experts per rank and the token all_to_all of expert parallelism (module docstring)."""
    E, k, layers = moe["experts"], moe["experts_per_token"], moe["moe_layers"]
    out = {"ep": mesh.ep, "experts_per_ep_rank": -(-E // mesh.ep),
           "expert_data_parallel_ranks": mesh.shard_group // mesh.ep,
           "token_all_to_all_bytes_per_step_per_rank": None,
           "rule": "4 x tokens per rank x top_k x hidden x 2 B x (ep - 1)/ep x MoE layers, "
                   "each way (dispatch and combine, forward and backward)"}
    if tokens_per_step:
        tokens = tokens_per_step / (mesh.world_size // mesh.tp)   # per data-parallel rank
        out["token_all_to_all_bytes_per_step_per_rank"] = int(
            4 * tokens * k * hidden * 2 * (mesh.ep - 1) / mesh.ep * layers)
    return out
