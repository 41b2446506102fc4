"""A model as the planner sees it: named parameter shapes, without any weights.

Three inputs, told apart by content (``load_model``):

- a Hugging Face ``config.json`` (families: llama, mistral, qwen2, gpt2, gpt_neox, and the
  mixture-of-experts families mixtral, qwen2_moe, qwen3_moe, deepseek_v3 of ``moe_shapes``):
  the parameter list ``model.named_parameters()`` would yield in transformers 5.x, with the
  same names (tied embeddings appear once, as torch de-duplicates them), computed from the
  architecture numbers;
- safetensors: a ``.safetensors`` file (only its header is read: an 8-byte little-endian
  length, then that many bytes of JSON; a file cut off after its header is fine) or a
  ``model.safetensors.index.json`` (each shard's header is read the same way);
- a list of named shapes: JSON ``{"name": [rows, cols], ...}`` or
  ``[{"name": ..., "shape": [...], "dtype": "bfloat16"}, ...]``.

A directory holding a ``config.json`` (preferred), an index or safetensors files also works.
Errors are ``ModelInputError`` (a ValueError) with one line that names the file. Every
number is checked against ``model_limits`` before anything proportional to it is built.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field

from ..formats.errors import FormatError
from ..formats.safetensors import read_header, read_index
from . import model_limits as limits
from .model_file import ModelInputError, check_regular, is_size, read_model_json
from .moe_shapes import MOE_FAMILIES, MoEInfo, moe_model

# an FSDP2 unit: one block of a layer stack (fully_shard is applied per block)
_BLOCK = re.compile(r"^(.*?(?:^|\.)(?:layers|h|blocks|block|layer)\.\d+)\.")


def unit_name(name: str) -> str:
    """The FSDP2 unit a parameter is gathered with: its layer block (``...layers.N``), or
    ``<root>`` (embeddings, final norm, head)."""
    m = _BLOCK.match(name)
    return m.group(1) if m else "<root>"


@dataclass(frozen=True)
class Tensor:
    """One parameter: its name as ``named_parameters()`` gives it, global shape, dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: str = "bfloat16"

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass
class ModelShapes:
    name: str
    family: str                   # HF model_type, "safetensors" or "shapes"
    tensors: list[Tensor]
    source: str                   # the file it came from
    tied_embeddings: bool = False
    notes: list[str] = field(default_factory=list)
    moe: MoEInfo | None = None    # the expert layout of a mixture-of-experts config
    _cache: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def numel(self) -> int:
        return sum(t.numel for t in self.tensors)

    def units(self) -> dict[str, int]:
        """Elements per FSDP2 unit: each layer block (``...layers.N``), and the root (the
        rest: embeddings, final norm, head), in order of first appearance."""
        key = ("units", len(self.tensors))
        if key not in self._cache:
            out: dict[str, int] = {}
            for t in self.tensors:
                unit = unit_name(t.name)
                out[unit] = out.get(unit, 0) + t.numel
            self._cache[key] = out
        return dict(self._cache[key])

    def largest_layer(self) -> int:
        """DeepSpeed's ``largest_layer_params``: the most parameters one module holds itself
        (not counting its children), a module being the name without its last part."""
        per: dict[str, int] = {}
        for t in self.tensors:
            mod = t.name.rsplit(".", 1)[0] if "." in t.name else ""
            per[mod] = per.get(mod, 0) + t.numel
        return max(per.values(), default=0)


# --------------------------------------------------------------------------------------------
# entry point
# --------------------------------------------------------------------------------------------
def load_model(path: str, dtype: str = "bfloat16") -> ModelShapes:
    """Read ``path`` (a config.json, safetensors file or index, shape list, or a directory
    holding one). ``dtype`` is the training parameter dtype given to config/shape inputs
    (safetensors headers carry their own, but training dtype is chosen by the caller)."""
    if not os.path.exists(path):
        raise ModelInputError(_missing(path))
    if os.path.isdir(path):
        return _load_dir(path, dtype)
    if path.endswith(".safetensors"):
        return from_safetensors([path], name=_stem(path), source=path)
    doc = _read_json(path)
    if isinstance(doc, dict) and "weight_map" in doc:
        return from_index(path)
    if isinstance(doc, dict) and ("model_type" in doc or "architectures" in doc):
        return from_hf_config(doc, name=_model_name(path, doc), source=path, dtype=dtype)
    return from_shape_list(doc, name=_stem(path), source=path, dtype=dtype)


def _load_dir(path: str, dtype: str) -> ModelShapes:
    cfg = os.path.join(path, "config.json")
    if os.path.isfile(cfg):
        return load_model(cfg, dtype)
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        return from_index(index)
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if files:
        return from_safetensors([os.path.join(path, f) for f in files],
                                name=os.path.basename(os.path.abspath(path)), source=path)
    raise ModelInputError(f"{path}: no config.json, model.safetensors.index.json or "
                          "*.safetensors in this directory")


def _read_json(path: str):
    return read_model_json(path)


def check_shapes(tensors: list[Tensor], source: str) -> list[Tensor]:
    """Refuse more than ``MAX_TENSORS`` tensors, or a shape of more than ``MAX_NDIM``
    dimensions or a size outside [0, MAX_DIM]: what the planner's arithmetic relies on."""
    if len(tensors) > limits.MAX_TENSORS:
        raise ModelInputError(f"{source}: {len(tensors)} tensors; the planner reads at most "
                              f"{limits.MAX_TENSORS}")
    for t in tensors:
        if len(t.shape) > limits.MAX_NDIM or not all(
                type(d) is int and 0 <= d <= limits.MAX_DIM for d in t.shape):
            raise ModelInputError(f"{source}: {t.name[:200]!r}: shape must have at most "
                                  f"{limits.MAX_NDIM} sizes, each an integer in [0, 2**63); got "
                                  f"{_short_shape(t.shape)}")
    return tensors


def _short_shape(shape) -> str:
    text = repr(shape)
    return text if len(text) <= 200 else text[:200] + "..."


def _stem(path: str) -> str:
    base = os.path.basename(os.path.abspath(path))
    for ext in (".safetensors", ".json"):
        base = base.removesuffix(ext)
    return base


def _missing(path: str) -> str:
    """The error for a --model that is not on disk; a Hugging Face hub id ("org/name") gets
    told that only local files are read, and how to fetch the one file the plan needs."""
    hub_like = (path.count("/") == 1 and not path.startswith((".", "/", "~"))
                and not path.endswith((".json", ".safetensors")))
    if hub_like:
        return (f"{path}: not a local file or directory; plan reads local files only and "
                f"downloads nothing. Fetch the model's config.json (for example `hf download "
                f"{path} config.json --local-dir {path.split('/')[-1]}`) and pass its path")
    return f"{path}: no such file or directory"


def _model_name(path: str, doc: dict) -> str:
    """The model's label: the config's own ``_name_or_path`` (a hub id), else its architecture
    and the file it came from (a folder's name says nothing of the model)."""
    name = doc.get("_name_or_path")
    if isinstance(name, str) and name:
        return name
    archs = doc.get("architectures")
    arch = archs[0] if isinstance(archs, list) and archs and isinstance(archs[0], str) else None
    kind = arch or (doc.get("model_type") if isinstance(doc.get("model_type"), str) else None)
    return f"{kind} from {path}" if kind else _stem(path)


# --------------------------------------------------------------------------------------------
# Hugging Face config.json
# --------------------------------------------------------------------------------------------
def from_hf_config(cfg: dict, name: str = "model", source: str = "<config>",
                   dtype: str = "bfloat16") -> ModelShapes:
    """The parameters of ``AutoModelForCausalLM.from_config(cfg)`` by name and shape."""
    family = cfg.get("model_type")
    if family is None:
        raise ModelInputError(f"{source}: config has no 'model_type'; known families: "
                              f"{', '.join(known_families())}")
    builder = FAMILIES.get(family)
    if builder is None and family not in MOE_FAMILIES:
        raise ModelInputError(f"{source}: unknown model family {family!r}; known: "
                              f"{', '.join(known_families())} (or pass a safetensors header "
                              "or a list of shapes)")
    _check_config_numbers(cfg, source, family)
    moe = None
    try:
        if family in MOE_FAMILIES:
            shapes, tied, moe = moe_model(cfg, family)
        else:
            shapes, tied = builder(cfg)
    except KeyError as e:
        raise ModelInputError(f"{source}: {family} config lacks {e.args[0]!r}") from None
    except (TypeError, ValueError, ZeroDivisionError) as e:
        raise ModelInputError(f"{source}: {family} config has a bad value: {e}") from None
    tensors = [Tensor(n, tuple(int(d) for d in s), dtype) for n, s in shapes]
    for t in tensors:
        if any(d < 0 for d in t.shape):
            raise ModelInputError(f"{source}: {t.name} would have a negative size {t.shape}")
    return ModelShapes(name, family, check_shapes(tensors, source), source, tied, moe=moe)


# config numbers that multiply into the length of the parameter list
_COUNT_KEYS = ("num_hidden_layers", "n_layer", "num_local_experts", "num_experts",
               "n_routed_experts", "num_experts_per_tok", "n_shared_experts",
               "first_k_dense_replace", "moe_layer_freq", "decoder_sparse_step",
               "q_lora_rank", "kv_lora_rank")


def _check_config_numbers(cfg: dict, source: str, family: str) -> None:
    """Every architecture number an integer in [0, MAX_DIM], and the parameter list the
    config expands to at most MAX_TENSORS long: checked before it is built."""
    for key, value in cfg.items():
        if key in _COUNT_KEYS or key.endswith(("_size", "_heads", "_dim", "n_embd", "n_inner",
                                               "n_positions", "max_position_embeddings")):
            if value is None:
                continue
            if not is_size(value):
                raise ModelInputError(f"{source}: {family} config: {key} is {_short_shape(value)}, "
                                      f"expected an integer in [0, 2**63)")
    layers = max(int(cfg.get(k) or 0) for k in _COUNT_KEYS[:2])
    per_layer = 24  # tensors of one block at most (experts are grouped: 2 tensors per layer)
    if layers * per_layer > limits.MAX_TENSORS:
        raise ModelInputError(f"{source}: {family} config: {layers} layers of {per_layer} tensors "
                              f"each; the planner reads at most {limits.MAX_TENSORS} tensors")


def _get(cfg: dict, *keys, default=None):
    for k in keys:
        if k in cfg and cfg[k] is not None:
            return cfg[k]
    if default is not None:
        return default
    raise KeyError(keys[0])


def _llama_like(cfg: dict, qkv_bias: bool | None = None):
    h = int(_get(cfg, "hidden_size"))
    layers = int(_get(cfg, "num_hidden_layers"))
    heads = int(_get(cfg, "num_attention_heads"))
    kv = int(_get(cfg, "num_key_value_heads", default=heads))
    head_dim = int(cfg.get("head_dim") or h // heads)
    ffn = int(_get(cfg, "intermediate_size"))
    vocab = int(_get(cfg, "vocab_size"))
    tied = bool(cfg.get("tie_word_embeddings", False))
    attn_bias = bool(cfg.get("attention_bias", False)) if qkv_bias is None else qkv_bias
    o_bias = bool(cfg.get("attention_bias", False))
    mlp_bias = bool(cfg.get("mlp_bias", False))
    out = [("model.embed_tokens.weight", (vocab, h))]
    for i in range(layers):
        p = f"model.layers.{i}."
        for proj, rows in (("q_proj", heads * head_dim), ("k_proj", kv * head_dim),
                           ("v_proj", kv * head_dim)):
            out.append((p + f"self_attn.{proj}.weight", (rows, h)))
            if attn_bias:
                out.append((p + f"self_attn.{proj}.bias", (rows,)))
        out.append((p + "self_attn.o_proj.weight", (h, heads * head_dim)))
        if o_bias:
            out.append((p + "self_attn.o_proj.bias", (h,)))
        for proj, shape in (("gate_proj", (ffn, h)), ("up_proj", (ffn, h)),
                            ("down_proj", (h, ffn))):
            out.append((p + f"mlp.{proj}.weight", shape))
            if mlp_bias:
                out.append((p + f"mlp.{proj}.bias", (shape[0],)))
        out += [(p + "input_layernorm.weight", (h,)), (p + "post_attention_layernorm.weight", (h,))]
    out.append(("model.norm.weight", (h,)))
    if not tied:
        out.append(("lm_head.weight", (vocab, h)))
    return out, tied


def _gpt2(cfg: dict):
    n = int(_get(cfg, "n_embd", "hidden_size"))
    layers = int(_get(cfg, "n_layer", "num_hidden_layers"))
    vocab = int(_get(cfg, "vocab_size"))
    pos = int(_get(cfg, "n_positions", "max_position_embeddings"))
    inner = int(cfg.get("n_inner") or 4 * n)
    tied = bool(cfg.get("tie_word_embeddings", True))
    out = [("transformer.wte.weight", (vocab, n)), ("transformer.wpe.weight", (pos, n))]
    for i in range(layers):
        p = f"transformer.h.{i}."
        # Conv1D stores its weight as (in, out)
        out += [(p + "ln_1.weight", (n,)), (p + "ln_1.bias", (n,)),
                (p + "attn.c_attn.weight", (n, 3 * n)), (p + "attn.c_attn.bias", (3 * n,)),
                (p + "attn.c_proj.weight", (n, n)), (p + "attn.c_proj.bias", (n,)),
                (p + "ln_2.weight", (n,)), (p + "ln_2.bias", (n,)),
                (p + "mlp.c_fc.weight", (n, inner)), (p + "mlp.c_fc.bias", (inner,)),
                (p + "mlp.c_proj.weight", (inner, n)), (p + "mlp.c_proj.bias", (n,))]
    out += [("transformer.ln_f.weight", (n,)), ("transformer.ln_f.bias", (n,))]
    if not tied:
        out.append(("lm_head.weight", (vocab, n)))
    return out, tied


def _gpt_neox(cfg: dict):
    h = int(_get(cfg, "hidden_size"))
    layers = int(_get(cfg, "num_hidden_layers"))
    ffn = int(_get(cfg, "intermediate_size"))
    vocab = int(_get(cfg, "vocab_size"))
    tied = bool(cfg.get("tie_word_embeddings", False))
    bias = bool(cfg.get("attention_bias", True))
    out = [("gpt_neox.embed_in.weight", (vocab, h))]
    for i in range(layers):
        p = f"gpt_neox.layers.{i}."
        out += [(p + "input_layernorm.weight", (h,)), (p + "input_layernorm.bias", (h,)),
                (p + "post_attention_layernorm.weight", (h,)),
                (p + "post_attention_layernorm.bias", (h,)),
                (p + "attention.query_key_value.weight", (3 * h, h))]
        if bias:
            out.append((p + "attention.query_key_value.bias", (3 * h,)))
        out.append((p + "attention.dense.weight", (h, h)))
        if bias:
            out.append((p + "attention.dense.bias", (h,)))
        out += [(p + "mlp.dense_h_to_4h.weight", (ffn, h)), (p + "mlp.dense_h_to_4h.bias", (ffn,)),
                (p + "mlp.dense_4h_to_h.weight", (h, ffn)), (p + "mlp.dense_4h_to_h.bias", (h,))]
    out += [("gpt_neox.final_layer_norm.weight", (h,)), ("gpt_neox.final_layer_norm.bias", (h,))]
    if not tied:
        out.append(("embed_out.weight", (vocab, h)))
    return out, tied


def known_families() -> list[str]:
    """Every ``model_type`` a config.json may name, dense and mixture-of-experts."""
    return sorted(set(FAMILIES) | set(MOE_FAMILIES))


FAMILIES = {
    "llama": lambda c: _llama_like(c),
    "mistral": lambda c: _llama_like(c),
    "qwen2": lambda c: _llama_like(c, qkv_bias=True),   # q/k/v carry a bias, o_proj not
    "gpt2": _gpt2,
    "gpt_neox": _gpt_neox,
}


# --------------------------------------------------------------------------------------------
# safetensors headers
# --------------------------------------------------------------------------------------------
def from_safetensors(paths: list[str], name: str, source: str) -> ModelShapes:
    """Shapes and dtypes from the headers of safetensors files (the one header codec,
    ``formats.safetensors``; only the first 8 + N bytes of each file are read)."""
    tensors = []
    for path in paths:
        check_regular(path)
        try:
            entries, _, _ = read_header(path, check_data=False)
        except FormatError as e:
            raise ModelInputError(str(e)) from None
        tensors += [Tensor(key, e.shape, e.dtype.name if e.dtype else e.code.lower())
                     for key, e in entries.items()]
        check_shapes(tensors, path)
    if not tensors:
        raise ModelInputError(f"{source}: no tensors in the safetensors header(s)")
    return ModelShapes(name, "safetensors", tensors, source,
                       notes=["shapes from safetensors headers; a tied head stored once counts once"])


def from_index(path: str) -> ModelShapes:
    """The tensors a ``model.safetensors.index.json`` maps, from its shards' headers (only
    the headers are read: a shard cut after its header is enough)."""
    try:
        _, weight_map, _ = read_index(path)
    except FormatError as e:
        raise ModelInputError(str(e)) from None
    if not weight_map:
        raise ModelInputError(f"{path}: 'weight_map' is empty")
    folder = os.path.dirname(os.path.abspath(path))
    shards = list(dict.fromkeys(weight_map.values()))  # in the order the index names them
    model = from_safetensors([os.path.join(folder, s) for s in shards],
                             name=os.path.basename(folder), source=path)
    wanted = set(weight_map)
    model.tensors = [t for t in model.tensors if t.name in wanted]
    return model


# --------------------------------------------------------------------------------------------
# a list of named shapes
# --------------------------------------------------------------------------------------------
def from_shape_list(doc, name: str = "model", source: str = "<shapes>",
                    dtype: str = "bfloat16") -> ModelShapes:
    items = []
    if isinstance(doc, dict) and isinstance(doc.get("tensors"), (list, dict)):
        doc = doc["tensors"]
    if isinstance(doc, dict):
        items = [(k, v, dtype) for k, v in doc.items()]
    elif isinstance(doc, list):
        for i, e in enumerate(doc):
            if not isinstance(e, dict) or "name" not in e or "shape" not in e:
                raise ModelInputError(f"{source}: entry {i} needs 'name' and 'shape'")
            items.append((e["name"], e["shape"], e.get("dtype", dtype)))
    else:
        raise ModelInputError(f"{source}: not a model description (a config.json with "
                              "'model_type', a safetensors index, or a list of named shapes)")
    tensors = []
    for key, shape, dt in items:
        if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
            raise ModelInputError(f"{source}: {str(key)[:200]!r}: shape must be a list of "
                                  f"non-negative integers, got {_short_shape(shape)}")
        tensors.append(Tensor(str(key), tuple(shape), str(dt)))
    if not tensors:
        raise ModelInputError(f"{source}: no tensors listed")
    return ModelShapes(name, "shapes", check_shapes(tensors, source), source)
