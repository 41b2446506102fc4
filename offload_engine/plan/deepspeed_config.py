"""A DeepSpeed JSON config translated into a StoreConfig and ZeroMuon's arguments.

Every leaf key of the input is accounted for: *mapped* (with the rule that computed our
value) or *ignored* (with the reason). The rules are the table in docs/migrate.md; each
``_rule_*`` function below owns one part of the DeepSpeed config. Nothing here imports
torch: the result is plain data, the store part validated by ``StoreConfig``.

DeepSpeed's names and defaults are those of 0.19.8 (``runtime/zero/offload_config.py``,
``runtime/swap_tensor/constants.py``, ``runtime/zero/config.py``); they are facts about its
config format, restated here as the keys we read.
"""

from __future__ import annotations

import fnmatch
import os
from dataclasses import asdict, dataclass, field

from ..store.config import StoreConfig, default
from ..units import MiB, PAGE, format_bytes
from ..errors import InputError
from ..jsonlimits import read_json_file
from .deepspeed_keys import check_keys
from .deepspeed_loop import loop_code

# Bytes of a DeepSpeed config read: real ones are 1-10 KB; a config is read whole.
MAX_CONFIG_BYTES = 1 * MiB
NVME_SUBDIR = "offload-engine"     # our group beside DeepSpeed's zero_stage_3/ swap folders
# Buckets a ZeroMuon step holds at once with state on NVMe: 2 to 6 for the layouts we know
# (optim/pool_budget.working_buckets); ZeroMuon refuses a smaller pool by name.
MIN_POOL_BUCKETS = 8
MAX_THREADS = 256                  # StoreConfig's limits on io_threads and queue_depth
MAX_QUEUE_DEPTH = 1024

# DeepSpeed defaults of the keys our values are computed from
DS_BUFFER_COUNT = 4                # offload_optimizer.buffer_count
DS_SUB_GROUP_SIZE = 10**9          # zero_optimization.sub_group_size (elements)
DS_AIO = {"block_size": 1 << 20, "queue_depth": 8, "intra_op_parallelism": 1}

ADAM_TYPES = {"adam", "adamw", "fusedadam", "cpuadam", "deepspeedcpuadam"}
MUON_TYPES = {"muon", "muonwithauxadam"}

WHY_FSDP = ("FSDP2's parameter and gradient communication, not the optimizer state's: set "
            "on fully_shard (mesh, reshard_after_forward) or torch.distributed")
WHY_LOOP = "a setting of the training loop, not of the optimizer state: keep it in your loop"


@dataclass
class KeyReport:
    """One leaf key of the DeepSpeed config: what became of it."""

    key: str              # dotted path, e.g. "zero_optimization.offload_optimizer.device"
    value: object
    status: str           # "mapped" or "ignored"
    rule: str             # how our value was computed, or why the key is not used
    target: str = ""      # our key(s) it set, e.g. "store.default_home"


@dataclass
class Translation:
    """The store config (validated, as a dict of StoreConfig keys), ZeroMuon's keyword
    arguments, one report per input key, and warnings that need the user's attention."""

    store: dict
    optimizer: dict
    report: list[KeyReport]
    warnings: list[str] = field(default_factory=list)
    loop_code: dict[str, list[str]] = field(default_factory=dict)  # key -> torch lines

    def as_json(self) -> dict:
        return {"store": self.store, "optimizer": self.optimizer,
                "report": [asdict(r) for r in self.report], "warnings": self.warnings,
                "loop_code": self.loop_code}


def leaves(tree: dict, prefix: str = "") -> dict[str, object]:
    """``{dotted key: value}`` of every non-dict value in ``tree`` (lists are values)."""
    out = {}
    for k, v in tree.items():
        path = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(leaves(v, path + "."))
        else:
            out[path] = v
    return out


class _Builder:
    """Collects our values and the report while the rules run."""

    def __init__(self, ds: dict, source: str):
        self.ds = ds
        self.keys = check_keys(ds, leaves(ds), source)
        self.store: dict = {}
        self.optimizer: dict = {}
        self.adamw: dict = {}
        self.report: dict[str, KeyReport] = {}
        self.warnings: list[str] = []

    def get(self, key: str, fallback=None):
        value = self.keys.get(key, fallback)
        return fallback if value == "auto" else value

    def mapped(self, key: str, rule: str, target: str) -> None:
        if key in self.keys and key not in self.report:
            if self.keys[key] == "auto":
                self.ignored(key, "'auto' is filled in by the Hugging Face Trainer at run "
                                  "time; write the value to have it translated")
                return
            self.report[key] = KeyReport(key, self.keys[key], "mapped", rule, target)

    def ignored(self, key: str, reason: str) -> None:
        if key in self.keys and key not in self.report:
            self.report[key] = KeyReport(key, self.keys[key], "ignored", reason)

    def ignore_matching(self, pattern: str, reason: str) -> None:
        for key in self.keys:
            if fnmatch.fnmatchcase(key, pattern):
                self.ignored(key, reason)


def translate(ds: dict, source: str = "DeepSpeed config") -> Translation:
    """Translate DeepSpeed config ``ds`` (the parsed JSON). Raises ``InputError`` naming
    ``source`` when the input is not a JSON object, a key the rules read has a value of the
    wrong type or range (``deepspeed_keys.check_keys``, naming the key), or the result is
    not a valid store config (e.g. NVMe offload without ``nvme_path``)."""
    if not isinstance(ds, dict):
        raise InputError(f"{source}: a DeepSpeed config is a JSON object, got {type(ds).__name__}")
    b = _Builder(ds, source)
    _rule_offload_optimizer(b)
    _rule_aio(b)
    _rule_muon_momentum(b)
    _rule_optimizer(b)
    _rule_precision(b)
    _rule_rest(b)
    store = StoreConfig.load(b.store, source=f"{source} (translated)")
    written = store.model_dump(mode="json")
    if not store.gpu_budget:
        # 0 is "not given": ZeroMuon then sizes the GPU staging a CUDA run needs itself;
        # written out, a 0 read as a request for none
        written.pop("gpu_budget", None)
    return Translation(written, b.optimizer, [b.report[k] for k in b.keys], b.warnings,
                       loop_code(ds))


def _rule_offload_optimizer(b: _Builder) -> None:
    base = "zero_optimization.offload_optimizer."
    device = b.get(base + "device", "none")
    if device == "nvme":
        b.store["default_home"] = "nvme"
        path = b.get(base + "nvme_path")
        if path:
            b.store["nvme_paths"] = [os.path.join(str(path), NVME_SUBDIR)]
            b.mapped(base + "nvme_path", f"nvme_paths = [nvme_path/{NVME_SUBDIR}] (a folder of "
                                         f"its own beside DeepSpeed's swap folders)",
                     "store.nvme_paths")
        count = b.get(base + "buffer_count", DS_BUFFER_COUNT)
        sub_group = b.get("zero_optimization.sub_group_size", DS_SUB_GROUP_SIZE)
        bucket = default("bucket_bytes")
        budget = max(MIN_POOL_BUCKETS * bucket,
                     -(-int(count) * int(sub_group) * 4 // bucket) * bucket)
        b.store["cpu_budget"] = budget
        why = (f"cpu_budget = buffer_count x sub_group_size x 4 bytes, rounded up to whole "
               f"{format_bytes(bucket)} buckets and at least {MIN_POOL_BUCKETS} of them (the "
               f"step's working set): the most pinned memory DeepSpeed's swapper takes per "
               f"rank (here {format_bytes(budget)}); our pool is a fixed budget instead, and "
               f"`offload-engine plan` sizes it from the model")
        b.mapped(base + "buffer_count", why, "store.cpu_budget")
        b.mapped("zero_optimization.sub_group_size", why, "store.cpu_budget")
        b.warnings.append(f"cpu_budget is {format_bytes(budget)} per rank, what DeepSpeed "
                          f"would pin at most; run `offload-engine plan` for the model's need")
    elif device == "cpu":
        b.store["default_home"] = "cpu"
        b.warnings.append("optimizer state in host memory: set cpu_budget to the state's bytes "
                          "per rank (`offload-engine plan` prints it); DeepSpeed's CPU offload "
                          "has no budget")
    else:
        b.store["default_home"] = "gpu"
        b.warnings.append("no optimizer offload: state stays in GPU memory (default_home gpu); "
                          "set gpu_budget (`offload-engine plan`), or offload to nvme")
    b.mapped(base + "device", "nvme -> default_home nvme; cpu -> default_home cpu (pinned host "
                              "pool); none -> default_home gpu", "store.default_home")
    b.ignored(base + "nvme_path", "only used with device nvme")
    b.ignored(base + "buffer_count", "only used with device nvme (it sizes NVMe swap buffers)")
    b.ignored("zero_optimization.sub_group_size",
              "DeepSpeed's swap tile; ours is bucket_bytes (64 MiB), sized for the pinned pool "
              "and the disk, not for the model")
    b.ignored(base + "pin_memory", "the store's pool is one pinned arena (pinned where CUDA "
                                   "is present); under a tight memlock limit lower cpu_budget")
    b.ignored(base + "fast_init", "nothing to skip: chunk files are created at their first "
                                  "write, preallocated without writing zeros")
    for key in ("pipeline_read", "pipeline_write"):
        b.ignored(base + key, "always on: the store reads prefetch_depth buckets ahead and "
                              "writes behind the step")
    b.ignored(base + "ratio", "partial CPU Adam has no equivalent: the step runs where the "
                              "model is, on state lent by the store")
    b.ignored(base + "super_offload", "Superchip CPU-Adam offload has no equivalent")
    b.ignored(base + "cpuadam_cores_perc", "CPU Adam's thread share: the step does not run "
                                           "on the CPU")
    if b.get(base + "ratio", 1.0) not in (1, 1.0):
        b.warnings.append("offload_optimizer.ratio < 1 (part of the step on the GPU) has no "
                          "equivalent; all state follows default_home")
    b.ignore_matching("zero_optimization.offload_param.*",
                      "offload-engine offloads optimizer state only; parameters stay sharded "
                      "on the GPU by FSDP2")
    b.ignore_matching("zero_optimization.offload_optimizer.*",
                      "not a key DeepSpeed 0.19.8 documents for offload_optimizer")


def _rule_aio(b: _Builder) -> None:
    block = b.get("aio.block_size", DS_AIO["block_size"])
    aligned = max(PAGE, -(-int(block) // PAGE) * PAGE)
    b.store["block_size"] = aligned
    b.mapped("aio.block_size", "block_size = aio.block_size, rounded up to a multiple of 4096 "
                               "bytes", "store.block_size")
    qd = int(b.get("aio.queue_depth", DS_AIO["queue_depth"]))
    parallel = int(b.get("aio.intra_op_parallelism", DS_AIO["intra_op_parallelism"]))
    in_flight = max(1, min(MAX_QUEUE_DEPTH, qd * parallel))
    b.store["queue_depth"] = in_flight
    b.store["io_threads"] = min(in_flight, MAX_THREADS)
    why = ("the same requests in flight: DeepSpeed keeps queue_depth libaio requests on each "
           "of intra_op_parallelism threads; our threads each issue one blocking call, so "
           "queue_depth = aio.queue_depth x intra_op_parallelism and io_threads = queue_depth "
           f"(at most {MAX_THREADS})")
    for key in ("aio.queue_depth", "aio.intra_op_parallelism"):
        b.mapped(key, why, "store.queue_depth, store.io_threads")
    if "aio.thread_count" in b.keys:
        b.ignored("aio.thread_count", "DeepSpeed 0.19.8 does not read it (renamed "
                                      "intra_op_parallelism), so the run used "
                                      f"{parallel} thread(s); translated as it ran")
        b.warnings.append("aio.thread_count is ignored by DeepSpeed 0.19.8 (it reads "
                          "intra_op_parallelism): your DeepSpeed run did not use it either")
    b.ignored("aio.single_submit", "a libaio submission detail: requests are issued one per "
                                   "thread call")
    b.ignored("aio.overlap_events", "always as overlap_events=true: a finished request is "
                                    "replaced at once, queue_depth stay in flight")
    b.ignored("aio.use_gds", "GPUDirect Storage is not used: state moves through the pinned "
                             "pool")
    b.ignore_matching("aio.*", "not a key DeepSpeed 0.19.8 reads in aio")


def _rule_muon_momentum(b: _Builder) -> None:
    key = "zero_optimization.save_muon_momentum_buffer_in_memory"
    if b.get(key) is True:
        b.store["homes"] = {"rank*/muon_momentum": "cpu"}
    b.mapped(key, "true -> homes {'rank*/muon_momentum': 'cpu'} (every rank's Muon momentum "
                  "lives in the pinned pool); false -> it follows default_home", "store.homes")


def _rule_optimizer(b: _Builder) -> None:
    if "optimizer.type" not in b.keys:
        b.warnings.append("no optimizer block (a client optimizer): ZeroMuon's defaults apply; "
                          "pass your optimizer's settings to ZeroMuon")
        b.ignore_matching("optimizer.*", "no optimizer type given")
        return
    kind = str(b.get("optimizer.type"))
    p = "optimizer.params."
    muon = kind.lower() in MUON_TYPES
    if kind.lower() in ADAM_TYPES:
        b.optimizer["use_muon"] = "none"
        b.mapped("optimizer.type", "Adam/AdamW -> every parameter on ZeroMuon's AdamW "
                                   "(use_muon 'none'): the run continues as it was",
                 "optimizer.use_muon")
    elif muon:
        b.optimizer["use_muon"] = "default"
        b.mapped("optimizer.type", "Muon -> ZeroMuon's rule (use_muon 'default'): 2-D weights "
                                   "on Muon except embeddings and output heads, as DeepSpeed's "
                                   "use_muon tagging", "optimizer.use_muon")
    else:
        b.optimizer["use_muon"] = "none"
        b.ignored("optimizer.type", f"{kind} has no ZeroMuon equivalent; AdamW is used")
        b.warnings.append(f"optimizer type {kind!r} is not Adam, AdamW or Muon: the translation "
                          f"uses AdamW")
    lr = b.get(p + "lr")
    adam_lr = b.get(p + "adam_lr", lr) if muon else lr
    if adam_lr is not None:
        b.adamw["lr"] = adam_lr
    b.mapped(p + "adam_lr", "AdamW lr (for the non-Muon parameters)", "optimizer.adamw.lr")
    if muon:
        muon_lr = b.get(p + "muon_lr", lr)
        if muon_lr is not None:
            b.optimizer["lr"] = muon_lr
        b.mapped(p + "muon_lr", "Muon lr", "optimizer.lr")
        b.mapped(p + "lr", "the lr of both halves unless muon_lr / adam_lr override it",
                 "optimizer.lr, optimizer.adamw.lr")
        b.optimizer["nesterov"] = True
        if b.get(p + "momentum") is not None:
            b.optimizer["momentum"] = b.get(p + "momentum")
        b.mapped(p + "momentum", "Muon momentum (DeepSpeed's Muon is always Nesterov)",
                 "optimizer.momentum")
        b.ignored(p + "ns_method", "ZeroMuon computes torch.optim.Muon's Newton-Schulz "
                                   "(5 quintic steps in bf16); DeepSpeed's 'gram' variant is "
                                   "not offered, so updates differ slightly")
    else:
        b.mapped(p + "lr", "AdamW lr", "optimizer.adamw.lr")
        b.ignored(p + "momentum", "Adam has no momentum key (betas)")
    for key, ours in (("betas", "betas"), ("eps", "eps"), ("amsgrad", "amsgrad")):
        if b.get(p + key) is not None:
            b.adamw[ours] = b.get(p + key)
        b.mapped(p + key, f"AdamW {ours}", f"optimizer.adamw.{ours}")
    wd = b.get(p + "weight_decay")
    if wd is not None:
        b.adamw["weight_decay"] = wd
        if muon:
            b.optimizer["weight_decay"] = wd
    b.mapped(p + "weight_decay", "decoupled weight decay of both halves (AdamW's and Muon's)"
             if muon else "AdamW weight_decay (decoupled)",
             "optimizer.weight_decay, optimizer.adamw.weight_decay" if muon
             else "optimizer.adamw.weight_decay")
    if b.get(p + "adam_w_mode", True) is False:
        b.warnings.append("adam_w_mode false (L2-regularised Adam) is not offered: ZeroMuon's "
                          "AdamW decays weights decoupled")
    b.mapped(p + "adam_w_mode", "true: decoupled decay, as ZeroMuon's AdamW (false is not "
                                "offered: a warning says so)", "optimizer.adamw")
    if b.get(p + "bias_correction", True) is False:
        b.warnings.append("bias_correction false is not offered: ZeroMuon's AdamW corrects bias "
                          "as torch.optim.AdamW")
    b.mapped(p + "bias_correction", "true: as torch.optim.AdamW (false is not offered: a "
                                    "warning says so)", "optimizer.adamw")
    for key in ("torch_adam", "fused", "adamw_mode"):
        b.ignored(p + key, "an implementation choice: ZeroMuon's AdamW is torch.optim.AdamW's "
                           "single-tensor math")
    b.ignore_matching("optimizer.*", f"not an option of ZeroMuon's {'Muon' if muon else 'AdamW'}")
    if b.adamw:
        b.optimizer["adamw"] = b.adamw


def _rule_precision(b: _Builder) -> None:
    for kind in ("bf16", "fp16"):
        if b.get(f"{kind}.enabled") is True:
            b.optimizer["master_weights"] = True
        b.mapped(f"{kind}.enabled", "true -> master_weights=True: fp32 master copies of the "
                                    "low-precision parameters live in the store",
                 "optimizer.master_weights")
    b.ignore_matching("fp16.*", "loss scaling belongs to the training loop "
                                "(torch.amp.GradScaler)")
    b.ignore_matching("bf16.*", "not used: bf16 needs no loss scaling")


def _rule_rest(b: _Builder) -> None:
    b.mapped("zero_optimization.stage", "every stage becomes FSDP2 fully_shard with ZeroMuon "
                                        "(state sharded per rank, as ZeRO-3)", "fully_shard")
    for key in ("stage3_gather_16bit_weights_on_model_save",
                "stage3_gather_fp16_weights_on_model_save", "gather_16bit_weights_on_model_save"):
        b.ignored(f"zero_optimization.{key}", "saving weights: save_checkpoint writes sharded "
                                              "state and `consolidate` writes the full weights")
    b.ignore_matching("zero_optimization.*", WHY_FSDP)
    code = loop_code(b.ds)
    if "gradient_clipping" in code:
        b.ignored("gradient_clipping", f"{WHY_LOOP}: {code['gradient_clipping'][0]}")
    if "scheduler" in code:
        b.ignore_matching("scheduler.*", "the LR schedule is the training loop's: the lines "
                                         "under 'training loop' below build the same schedule "
                                         "on ZeroMuon")
    b.ignore_matching("scheduler.*", "the LR schedule is the training loop's: build a "
                                     "torch.optim.lr_scheduler on ZeroMuon")
    for key in b.keys:
        b.ignored(key, "not an offload, optimizer or precision setting" if "." in key
                  else WHY_LOOP)


def load(path: str) -> Translation:
    """Read and translate the DeepSpeed JSON config at ``path``: strict JSON of at most
    ``MAX_CONFIG_BYTES`` from a regular file (``jsonlimits.read_json_file``); errors name
    the file (and the key)."""
    ds = read_json_file(path, MAX_CONFIG_BYTES, what="DeepSpeed config")
    return translate(ds, source=path)
