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

A shard group must fill whole nodes (the usual layouts: shard within nodes, replicate
across them; or dp x tp over all ranks): then every node holds ranks of one shard group and
the per-node figures are exact for every node.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

from ..optim.owners import shape_ns_flops
from ..errors import InputError

# torchtitan's [parallelism] keys, and the short names --mesh takes
TORCHTITAN_KEYS = {"data_parallel_replicate_degree": "dp_replicate",
                   "data_parallel_shard_degree": "dp_shard",
                   "tensor_parallel_degree": "tp"}
AXES = ("dp_replicate", "dp_shard", "tp")


@dataclass(frozen=True)
class Mesh:
    """Degrees of the mesh: replicas (HSDP), shards (FSDP) and tensor-parallel ranks."""

    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1

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
    if os.path.isfile(text):
        with open(text, encoding="utf-8") as f:
            text = f.read()
    text = text.strip()
    if text.startswith("{"):
        try:
            block = json.loads(text)
        except json.JSONDecodeError as e:
            raise InputError(f"--mesh {source}: not valid JSON: {e}") from None
        block = block.get("parallelism", block) if isinstance(block, dict) else block
        if not isinstance(block, dict):
            raise InputError(f"--mesh {source}: expected a JSON object of parallelism degrees")
        degrees = {TORCHTITAN_KEYS[k]: v for k, v in block.items() if k in TORCHTITAN_KEYS}
        others = sorted(k for k, v in block.items()
                        if k not in TORCHTITAN_KEYS and k.endswith("_degree") and v not in (1, None))
        if others:
            raise InputError(f"--mesh {source}: the planner models dp_replicate, dp_shard and "
                             f"tp only, not {', '.join(others)}")
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
    rest = [k for k, v in degrees.items() if v == -1]
    if len(rest) > 1:
        raise InputError(f"--mesh {source}: only one degree may be -1")
    if rest:
        known = math.prod(v for v in degrees.values() if v != -1)
        if world_size is None or world_size % known:
            raise InputError(f"--mesh {source}: {rest[0]} = -1 needs --world-size, a multiple "
                             f"of the other degrees ({known})")
        degrees[rest[0]] = world_size // known
    mesh = Mesh(**degrees)
    if world_size is not None and mesh.world_size != world_size:
        raise InputError(f"--mesh {source}: the degrees multiply to {mesh.world_size} ranks, "
                         f"but --world-size is {world_size}")
    return mesh


def check_nodes(mesh: Mesh, gpus_per_node: int) -> None:
    """A shard group must fill whole nodes (module docstring)."""
    if mesh.world_size % gpus_per_node:
        raise InputError(f"--mesh: {mesh.world_size} ranks do not fill nodes of "
                         f"{gpus_per_node} GPUs")
    if mesh.shard_group % gpus_per_node and mesh.shard_group > 1:
        raise InputError(f"--mesh: a shard group (dp_shard x tp = {mesh.shard_group} ranks) "
                         f"must fill whole nodes of {gpus_per_node} GPUs; the planner does not "
                         f"model nodes holding parts of several shard groups")


def mesh_figures(mesh: Mesh, gpus_per_node: int, muon_shapes: list[tuple[int, int]],
                 ns_steps: int, node_read: int, node_written: int, state_bytes: int) -> dict:
    """What the mesh adds to a plan made over one shard group: bytes, FLOPs and copies.

    ``muon_shapes``: (rows, cols) of every Muon matrix, (experts, rows, cols) of a stack of
    expert matrices (one Newton-Schulz per expert); ``node_read``/``node_written``: NVMe
    bytes per step of the busiest node; ``state_bytes``: optimizer-state bytes of one shard
    group (its ranks' state summed)."""
    W, D, R = mesh.world_size, mesh.shard_group, mesh.dp_replicate
    p_muon = sum(math.prod(s) for s in muon_shapes)
    each_way = 2 * p_muon * (W + D - 2) / (W * D) if W > 1 else 0
    flops = sum(shape_ns_flops(s, ns_steps) for s in muon_shapes)
    nodes = W // gpus_per_node
    return {
        "dp_replicate": mesh.dp_replicate, "dp_shard": mesh.dp_shard, "tp": mesh.tp,
        "world_size": W, "nodes": nodes, "shard_group_ranks": D,
        "nodes_per_shard_group": max(1, D // gpus_per_node),
        "state_copies": R,
        "state_bytes_all_replicas": state_bytes * R,
        "all_to_all_bytes_per_step_per_rank": {
            "each_way": int(each_way),
            "between_replicas": int(2 * (R - 1) * p_muon / W),
            "rule": "2 P_muon (W + D - 2) / (W D) each way; 2 (R - 1) P_muon / W between "
                    "replicas (even shapes, docs/optimizer.md)"},
        "newton_schulz_flops_per_step": {"total": flops, "per_rank": flops // W},
        "nvme_bytes_per_step_per_node": {"read": node_read, "written": node_written},
        "nvme_bytes_per_step_all_nodes": {"read": node_read * nodes,
                                          "written": node_written * nodes},
    }
