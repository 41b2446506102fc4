"""`offload-engine plan`: bytes per tier per rank and node, verdicts, NVMe traffic, a store config.

The byte model lives in ``offload_engine.plan`` (pure functions over shapes, bytes and
measured bandwidth); this module reads the command line, finds the machine's figures
(memory, NVMe free space, the bandwidth ``bench disk`` cached for the NVMe device), prints
the plan and optionally writes the store config (``--emit-config``).
"""

from __future__ import annotations

import argparse
import json
import os

from .args import aligned_size, byte_size, positive_int
from ..store.config import default as store_default
from ..units import MiB, format_bytes, parse_bytes
from ..errors import InputError

# the byte model (torch, the optimizer's code) is imported when the command runs, so that
# building the parser for other subcommands does not pay for it


def capacity(text: str) -> int:
    """A memory or disk size that must carry its unit: "80GB", "512GiB", "2TB" (or 0). A bare
    number would be bytes, and "--gpu-mem 80" meant 80 GB, not 80 bytes."""
    bare = text.strip().replace(".", "", 1).replace("_", "")
    if bare.isdigit() and float(text) != 0:
        raise argparse.ArgumentTypeError(
            f"{text!r} has no unit: write {text.strip()}GB or {text.strip()}GiB (a size "
            f"without a unit would be {text.strip()} bytes)")
    return byte_size(text)


def host_memory_arg(text: str) -> str:
    """--cpu-mem: "auto" (this machine's memory) or a size with its unit."""
    return text if text == "auto" else str(capacity(text))


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "plan", help="bytes per GPU, pinned CPU and NVMe for a model; verdicts and a store config",
        description="Plan a ZeroMuon run: for a model (Hugging Face config.json, safetensors "
                    "header or index, or a list of named shapes), a world size and a machine, "
                    "the bytes per rank and per node on GPU, pinned CPU and NVMe, whether "
                    "each fits, NVMe traffic and I/O time per step, all_to_all bytes, drive "
                    "writes per day, and the store config to use.")
    p.add_argument("--model", required=True, metavar="M",
                   help="config.json, *.safetensors, model.safetensors.index.json, a JSON list "
                        "of named shapes, or a directory holding one")
    p.add_argument("--world-size", type=positive_int, metavar="W",
                   help="ranks (GPUs); may be left out with --mesh")
    p.add_argument("--mesh", metavar="SPEC",
                   help="a 2-D mesh: dp_replicate=R,dp_shard=S,tp=T (missing axes 1), or a "
                        "torchtitan [parallelism] block as JSON or a JSON file (-1: the rest "
                        "of --world-size); per-rank and per-node figures are for one shard "
                        "group of S x T ranks, which must fill whole nodes; ep=N: expert "
                        "parallelism for a mixture of experts, N ranks taken from S x T")
    p.add_argument("--gpus-per-node", type=positive_int, default=8, metavar="N",
                   help="ranks per node (default 8; fewer if W is smaller)")
    p.add_argument("--gpu-mem", type=capacity, default=80 * 10**9, metavar="SIZE",
                   help="memory per GPU (default 80GB)")
    p.add_argument("--cpu-mem", type=host_memory_arg, default="auto", metavar="SIZE",
                   help="host memory per node of the machines you will run on (default auto: "
                        "this machine's, said in the plan's notes)")
    p.add_argument("--nvme", nargs="+", default=[], metavar="PATH",
                   help="NVMe directories of a node (state is striped over them); their free "
                        "space and the bandwidth `bench disk` cached for them are used")
    p.add_argument("--nvme-capacity", type=capacity, default=None, metavar="SIZE",
                   help="NVMe bytes free for state per node (default: free space of --nvme)")
    p.add_argument("--read-gbps", type=float, default=None, help="NVMe read GB/s per node (overrides the cache)")
    p.add_argument("--write-gbps", type=float, default=None, help="NVMe write GB/s per node (overrides the cache)")
    p.add_argument("--master-offload", action="store_true",
                   help="fp32 master weights (and fp32 optimizer state) in the store")
    p.add_argument("--optimizer", choices=("muon", "adamw"), default="muon",
                   help="muon: ZeroMuon's default split (Muon for hidden matrices, AdamW for the "
                        "rest); adamw: AdamW for every parameter (default muon)")
    p.add_argument("--param-dtype", choices=("bf16", "fp16", "fp32"), default="bf16",
                   help="dtype of the (sharded) parameters and gradients (default bf16)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cuda: GPUs train (default); cpu: a CPU-only run, no GPU tier")
    p.add_argument("--param-offload", action="store_true",
                   help="FSDP2 CPUOffloadPolicy: sharded parameters, gradients and the optimizer "
                        "step in host memory; the GPU holds gathered units and activations")
    bucket = store_default("bucket_bytes")
    p.add_argument("--bucket-bytes", type=aligned_size, default=bucket, metavar="SIZE",
                   help=f"store bucket size, a multiple of 4096 bytes (default {bucket // MiB}MiB)")
    depth = store_default("prefetch_depth")
    p.add_argument("--prefetch-depth", type=int, default=depth,
                   help=f"store prefetch depth (default {depth})")
    p.add_argument("--home", choices=("auto", "cpu", "nvme"), default="auto",
                   help="home tier of the state (default auto: cpu when it fits, else nvme)")
    p.add_argument("--cpu-budget", type=capacity, default=None, metavar="SIZE",
                   help="pinned pool per rank (default: chosen by the plan)")
    p.add_argument("--activations", type=capacity, default=0, metavar="SIZE",
                   help="activation bytes per GPU to add (not modelled; default 0)")
    p.add_argument("--step-time", type=float, default=None, metavar="S",
                   help="seconds per optimizer step, for drive writes per day")
    p.add_argument("--tokens-per-step", type=int, default=None,
                   help="global tokens per optimizer step: compute time = 6*P*T/(W*peak*MFU), P the active parameters of a mixture of experts")
    p.add_argument("--gpu-tflops", type=float, default=989.0, help="peak dense TFLOP/s per GPU (default 989)")
    p.add_argument("--mfu", type=float, default=0.4, help="model FLOPs utilization (default 0.4)")
    p.add_argument("--dwpd", type=float, default=1.0, help="drive endurance rating, drive writes per day (default 1)")
    p.add_argument("--drive-bytes", type=capacity, default=None, metavar="SIZE",
                   help="NVMe drive capacity per node, for writes per day (default: the --nvme devices')")
    p.add_argument("--emit-config", default=None, metavar="FILE",
                   help="write the store config (JSON, accepted by ZeroMuon as it is)")
    p.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    p.set_defaults(run=run)
    return p




def machine_from_args(args):
    from ..plan import disk_profile
    from ..plan.placement import usable_gpu
    from ..plan.planner import DEFAULT_IO, Machine
    cpu_mem = _host_memory() if args.cpu_mem == "auto" else parse_bytes(args.cpu_mem)
    if args.device == "cuda" and usable_gpu(args.gpu_mem) <= 0:
        raise InputError(f"--gpu-mem {format_bytes(args.gpu_mem)}: nothing is usable after the "
                         f"reserve of max(1 GiB, 5%); give the GPU's memory with its unit "
                         f"(80GB, 141GB)")
    m = Machine(gpu_mem=args.gpu_mem, cpu_mem=cpu_mem, gpus_per_node=args.gpus_per_node,
                nvme_paths=[os.path.abspath(p) for p in args.nvme], dwpd_rating=args.dwpd)
    devices: dict[int, str] = {}
    for path in m.nvme_paths:
        if not os.path.isdir(path):
            raise InputError(f"--nvme {path}: not an existing directory")
        devices.setdefault(os.stat(path).st_dev, path)
    if devices:
        import shutil
        m.nvme_capacity = sum(shutil.disk_usage(p).free for p in devices.values())
        sizes = [disk_profile.device_info(p).get("size_bytes") or shutil.disk_usage(p).total
                 for p in devices.values()]
        m.nvme_drive_bytes = sum(sizes)
        profiles = [disk_profile.load_profile(p) for p in devices.values()]
        found = [pr for pr in profiles if pr]
        if found:
            m.read_gbps = sum(pr["best"]["read_gbps"] for pr in found)
            m.write_gbps = sum(pr["best"]["write_gbps"] for pr in found)
            m.io = {k: found[0]["best"][k] for k in DEFAULT_IO}
            m.bandwidth_source = "bench disk: " + ", ".join(pr["file"] for pr in found)
            if len(found) < len(profiles):
                m.bandwidth_source += " (some --nvme devices were never measured)"
    if args.nvme_capacity is not None:
        m.nvme_capacity = args.nvme_capacity
    if args.drive_bytes is not None:
        m.nvme_drive_bytes = args.drive_bytes
    elif args.nvme_capacity is not None and not devices:
        m.nvme_drive_bytes = args.nvme_capacity
    if args.read_gbps is not None or args.write_gbps is not None:
        if not (args.read_gbps and args.write_gbps and args.read_gbps > 0 and args.write_gbps > 0):
            raise InputError("--read-gbps and --write-gbps go together and must be positive")
        m.read_gbps, m.write_gbps, m.bandwidth_source = args.read_gbps, args.write_gbps, "given"
    return m


def add_mesh(doc: dict, mesh, model, args, opts) -> None:
    """The plan of one shard group, extended to the whole mesh (plan/mesh.py)."""
    from ..plan.mesh import mesh_figures
    from ..plan.planner import kinds_for
    kinds = kinds_for(model, args.optimizer)
    shapes = [tuple(t.shape) for t, k in zip(model.tensors, kinds) if k == "muon"]
    t = doc["traffic"]
    figures = mesh_figures(mesh, args.gpus_per_node, shapes, opts.ns_steps,
                           max(t["nvme_read_bytes_per_step_per_node"]),
                           max(t["nvme_written_bytes_per_step_per_node"]),
                           int(doc["model"]["state_bytes_per_param"] * doc["model"]["params"]),
                           moe=doc["model"].get("moe"), tokens_per_step=args.tokens_per_step,
                           hidden=model.moe.hidden if model.moe else 0)
    doc["mesh"] = figures
    doc["inputs"].update(world_size=mesh.world_size, nodes=figures["nodes"])
    a2a, mesh_a2a = t["all_to_all_bytes_per_step_per_rank"], figures["all_to_all_bytes_per_step_per_rank"]
    if mesh.dp_replicate == 1:
        # dp x tp boxes of even shapes are the sizes of row blocks over dp x tp ranks: the
        # shard group's exact figure (bundles, owners, short rows) is the mesh's
        mesh_a2a.update(each_way=max(a2a["sent"], a2a["received"]), rule="exact: the shard "
                        "group's exchange, from the layout (boxes of row-block sizes)")
    else:
        a2a.update(sent=mesh_a2a["each_way"], received=mesh_a2a["each_way"],
                   design_formula=mesh_a2a["each_way"])
    if mesh.dp_replicate > 1:   # every replica orthogonalizes its own experts
        doc["traffic"]["newton_schulz_flops_per_step_per_rank"]["max"] = \
            figures["newton_schulz_flops_per_step"]["per_rank"]
    doc["verdict"]["notes"].append(
        f"mesh {mesh.dp_replicate} x {mesh.dp_shard} x {mesh.tp} (dp_replicate x dp_shard x "
        f"tp): per-rank and per-node figures are one shard group's ({mesh.shard_group} ranks, "
        f"boxes counted as row blocks of the same size); the smallest world size is of a "
        f"shard group")


def explain_inputs(doc: dict, args, machine) -> None:
    """Say where figures the user did not give came from, first among the notes: the host
    memory (--cpu-mem auto is this machine's, not the target node's), and why a smaller world
    size can fit when the one asked for does not."""
    notes = []
    auto = args.cpu_mem == "auto"
    doc["inputs"]["cpu_mem_source"] = "auto: this machine's memory" if auto else "given"
    if auto:
        notes.append(f"host memory per node is this machine's, {format_bytes(machine.cpu_mem)} "
                     f"(--cpu-mem auto): pass --cpu-mem SIZE for the nodes you will run on")
    v = doc["verdict"]
    smallest, asked = v["smallest_world_size"], doc["inputs"]["world_size"]
    if not v["fits"] and smallest and smallest < asked:
        notes.append(f"{smallest} ranks fit where {asked} do not because fewer ranks share each "
                     f"node's host memory ({min(smallest, args.gpus_per_node)} per node instead "
                     f"of {min(asked, args.gpus_per_node)}); more host memory per node "
                     f"(--cpu-mem) or fewer --gpus-per-node lets {asked} fit")
    v["notes"][:0] = notes


def _host_memory() -> int:
    import psutil
    return int(psutil.virtual_memory().total)


def run(args) -> int:
    from ..dtypes import dtype
    from ..plan.memory import PlanOptions
    from ..plan.model_shapes import load_model
    from ..plan.planner import Workload, build_plan
    from ..plan.mesh import check_nodes, parse_mesh
    mesh = parse_mesh(args.mesh, args.world_size) if args.mesh else None
    if mesh is None and args.world_size is None:
        raise InputError("--world-size is needed (or --mesh)")
    if mesh is not None:
        check_nodes(mesh, args.gpus_per_node)
    model = load_model(args.model)
    opts = PlanOptions(world_size=mesh.shard_group if mesh else args.world_size,
                       gpus_per_node=args.gpus_per_node,
                       param_dtype=dtype(args.param_dtype), master_weights=args.master_offload,
                       bucket_bytes=args.bucket_bytes, prefetch_depth=args.prefetch_depth,
                       device="cpu" if args.param_offload or args.device == "cpu" else "cuda",
                       gpu=args.device == "cuda", expert_parallel=mesh.ep if mesh else 1)
    if args.prefetch_depth < 0:
        raise InputError("--prefetch-depth must be >= 0")
    machine = machine_from_args(args)
    workload = Workload(step_time_s=args.step_time, tokens_per_step=args.tokens_per_step,
                        gpu_tflops=args.gpu_tflops, mfu=args.mfu, activations=args.activations,
                        compute_ranks=mesh.world_size if mesh else None)
    doc = build_plan(model, opts, machine, workload, optimizer=args.optimizer, home=args.home,
                     cpu_budget=args.cpu_budget)
    if mesh is not None:
        add_mesh(doc, mesh, model, args, opts)
    explain_inputs(doc, args, machine)
    if args.emit_config:
        with open(args.emit_config, "w") as f:
            json.dump(doc["store_config"], f, indent=2)
            f.write("\n")
        doc["store_config_file"] = os.path.abspath(args.emit_config)
    if args.json:
        print(json.dumps(doc, indent=2))
    else:
        print(format_plan(doc))
    return 0


# ----------------------------------------------------------------------------------------------
# text output
# ----------------------------------------------------------------------------------------------
_GPU_LABELS = {
    "params": "parameters (shard)", "grads": "gradients (shard)",
    "fsdp_unsharded_unit": "largest FSDP2 unit gathered (params + grads)",
    "all_to_all_buffers": "all_to_all send/receive buffers", "newton_schulz_workspace":
    "Newton-Schulz workspace", "optimizer_scratch": "optimizer scratch",
    "store_gpu_arena": "store staging arena (gpu_budget)", "activations": "activations (given)",
}


def _b(n) -> str:
    return "-" if n is None else format_bytes(n)


def _count(n: int) -> str:
    for unit, div in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= div:
            return f"{n / div:.2f}{unit}"
    return str(n)


def _flops(n: int) -> str:
    """Floating-point operations with a unit that keeps 3 decimals meaningful."""
    for unit, div in (("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6)):
        if n >= div:
            return f"{n / div:.3f} {unit}"
    return f"{n} FLOP"


def _verdict(v: dict) -> str:
    if v["fits"] is None and not v["used_bytes"]:
        return "not used"
    if v["fits"] is None:
        return f"{_b(v['used_bytes'])} (no capacity given)"
    word = "fits" if v["fits"] else "DOES NOT FIT"
    return (f"{_b(v['used_bytes'])} of {_b(v['capacity_bytes'])} usable: {word}, "
            f"headroom {_b(v['headroom_bytes']) if v['fits'] else '-' + _b(-v['headroom_bytes'])}")


def _where(i: dict) -> str:
    if not i["gpu"]:
        return "on CPU (no GPU)"
    return "on GPU" if i["device"] == "cuda" else "in host memory (FSDP2 CPU offload)"


def format_plan(doc: dict) -> str:
    m, i, pr, node = doc["model"], doc["inputs"], doc["per_rank"], doc["per_node"]
    t, v, pl, cfg = doc["traffic"], doc["verdict"], doc["placement"], doc["store_config"]
    out = [f"plan: {m['name']} ({m['family']}), {_count(m['params'])} parameters: "
           f"{_count(m['params_muon'])} Muon, {_count(m['params_adamw'])} AdamW "
           f"(f = {m['muon_fraction']:.3f})"]
    if m.get("moe"):
        e = m["moe"]
        shared = f" + {e['shared_experts']} shared" if e["shared_experts"] else ""
        out.append(f"      mixture of experts: {e['experts']} routed{shared} experts in "
                   f"{e['moe_layers']} layer(s), {e['experts_per_token']} per token; "
                   f"{_count(e['params_active'])} active parameters per token")
    out += [f"      world size {i['world_size']} = {i['nodes']} node(s) x {i['gpus_per_node']}, "
           f"{i['param_dtype']} parameters {_where(i)}, "
           f"{'fp32 masters + fp32 state' if i['master_weights'] else 'state in ' + i['param_dtype']}"
           f", optimizer {i['optimizer']}", ""]
    tiers = v["tiers"]
    if i["gpu"]:
        out.append(f"GPU per rank (rank {pr['rank']}): {_verdict(tiers['gpu'])}")
        for k, val in pr["gpu"].items():
            if k != "total" and val:
                out.append(f"  {_GPU_LABELS.get(k, k):<46} {_b(val):>12}")
    out.append(f"CPU per node ({node['ranks']} rank(s)): {_verdict(tiers['cpu'])}")
    c = pr["cpu"]
    out.append(f"  {'pinned pool per rank (cpu_budget)':<46} {_b(c['pinned_pool']):>12}")
    out.append(f"  {'  of which state homed on cpu':<46} {_b(c['state_homed_on_cpu']):>12}")
    out.append(f"  {'  of which NVMe cache and working room':<46} {_b(c['nvme_cache_and_working_room']):>12}")
    out.append(f"  {'host process estimate per rank (pageable)':<46} {_b(c['host_process_estimate']):>12}")
    for k, val in c.items():
        if k.startswith("host_") and k != "host_process_estimate" and val:
            out.append(f"  {k.removeprefix('host_') + ' (host memory)':<46} {_b(val):>12}")
    out.append(f"NVMe per node: {_verdict(tiers['nvme'])}")
    out.append(f"  {'chunk files per rank':<46} {_b(pr['nvme']['chunk_files']):>12}")
    out.append(f"  {'metadata (zarr.json) per rank':<46} {_b(pr['nvme']['metadata']):>12}")
    out.append("")
    st = pr["state"]
    kinds = ", ".join(f"{k} {_b(d['bytes'])}" for k, d in st["by_kind"].items())
    out.append(f"optimizer state per rank: {kinds} (home: {pl['default_home']}; {pl['reason']})")
    rd, wr = t["nvme_read_bytes_per_step_per_rank"], t["nvme_written_bytes_per_step_per_rank"]
    out.append(f"NVMe traffic per step and rank: read {_b(max(rd))}, written {_b(max(wr))}"
               + (f" (steps alternate: {_b(rd[0])} / {_b(rd[1])})" if rd[0] != rd[1] else ""))
    nr, nw = t["nvme_read_bytes_per_step_per_node"], t["nvme_written_bytes_per_step_per_node"]
    out.append(f"NVMe traffic per step and node: read {_b(max(nr))}, written {_b(max(nw))}")
    bw = t["bandwidth"]
    if not max(nr) and not max(nw):
        out.append("optimizer I/O time per step: none (no NVMe traffic)")
    elif bw["read_gbps"]:
        out.append(f"optimizer I/O time per step: {t['io_time_s_mean']:.3f} s at read "
                   f"{bw['read_gbps']:.2f} GB/s, write {bw['write_gbps']:.2f} GB/s per node "
                   f"({bw['source']})")
    else:
        out.append("optimizer I/O time per step: unknown (no bandwidth: `offload-engine bench "
                   "disk --path DIR`, then --nvme DIR)")
    if t["compute_time_s_per_step"] is not None:
        out.append(f"compute time per step (6*P*T/(W*peak*MFU)): {t['compute_time_s_per_step']:.3f} s")
    a = t["all_to_all_bytes_per_step_per_rank"]
    out.append(f"all_to_all per step and rank: sent {_b(a['sent'])}, received {_b(a['received'])} "
               f"in {a['calls']} calls")
    ns = t["newton_schulz_flops_per_step_per_rank"]
    if ns["max"]:
        out.append(f"Newton-Schulz per step and rank: {_flops(ns['max'])} on the busiest rank, "
                   f"{_flops(ns['mean'])} mean")
    if t["drive_writes_per_day"] is not None and max(nw):
        ok = "within" if t["endurance_ok"] else "OVER"
        out.append(f"drive writes per day: {t['drive_writes_per_day']:.2f} ({ok} the {t['dwpd_rating']:g} "
                   f"DWPD rating; {t['step_time_source']}, {t['step_time_s']:.3f} s per step)")
    if doc.get("mesh"):
        ms = doc["mesh"]
        a2a = ms["all_to_all_bytes_per_step_per_rank"]
        ns = ms["newton_schulz_flops_per_step"]
        nv = ms["nvme_bytes_per_step_all_nodes"]
        out.append(f"mesh: dp_replicate {ms['dp_replicate']} x dp_shard {ms['dp_shard']} x tp "
                   f"{ms['tp']}{' (ep ' + str(ms['ep']) + ')' if ms['ep'] > 1 else ''}"
                   f" = {ms['world_size']} ranks on {ms['nodes']} node(s); shard group "
                   f"{ms['shard_group_ranks']} ranks ({ms['nodes_per_shard_group']} node(s)), "
                   f"state kept {ms['state_copies']} time(s): {_b(ms['state_bytes_all_replicas'])}")
        out.append(f"  all_to_all per rank and step: {_b(a2a['each_way'])} each way, "
                   f"{_b(a2a['between_replicas'])} of it between replicas")
        out.append(f"  Newton-Schulz per step: {ns['total'] / 1e12:.1f} TFLOP, "
                   f"{ns['per_rank'] / 1e12:.3f} TFLOP per rank")
        out.append(f"  NVMe traffic per step, all nodes: read {_b(nv['read'])}, written "
                   f"{_b(nv['written'])}")
        ep = ms.get("expert_parallel")
        if ep:
            tok = ep["token_all_to_all_bytes_per_step_per_rank"]
            out.append(f"  experts: {ep['experts_per_ep_rank']} per ep rank, each over "
                       f"{ep['expert_data_parallel_ranks']} expert-data-parallel rank(s); token "
                       f"all_to_all per rank and step: "
                       + (f"{_b(tok)} each way" if tok is not None else "give --tokens-per-step"))
    out.append("")
    smallest = v["smallest_world_size"]
    out.append(f"verdict: {'FITS' if v['fits'] else 'DOES NOT FIT'}; binding tier: {v['binding'] or '-'}; "
               f"smallest world size that fits: {smallest if smallest else 'none found'}")
    for n in v["notes"]:
        out.append(f"  note: {n}")
    out.append(f"store config: default_home {cfg['default_home']}, cpu_budget {_b(cfg['cpu_budget'])}, "
               f"gpu_budget {_b(cfg['gpu_budget'])}, bucket {_b(cfg['bucket_bytes'])}, "
               f"{cfg['io_threads']} I/O threads, queue depth {cfg['queue_depth']}, block "
               f"{_b(cfg['block_size'])}" + (f", nvme_paths {cfg['nvme_paths']}" if cfg['nvme_paths'] else ""))
    if doc.get("store_config_file"):
        out.append(f"  written to {doc['store_config_file']}")
    return "\n".join(out)
