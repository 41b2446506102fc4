"""Mixture-of-experts models as the planner sees them: parameter shapes and the expert layout.

The parameter lists are those of ``AutoModelForCausalLM.from_config(cfg).named_parameters()``
in transformers 5.x, where every MoE family stores its routed experts as two grouped 3-D
tensors per layer: ``mlp.experts.gate_up_proj [E, 2 I, H]`` (gate rows first) and
``mlp.experts.down_proj [E, H, I]``, with the router ``mlp.gate.weight [E, H]``. Shared
experts (Qwen2-MoE, DeepSeek-V3) are ordinary 2-D projections; DeepSeek-V3's first
``first_k_dense_replace`` layers are dense MLPs and its attention is multi-head latent
attention (low-rank q and kv projections).

``MoEInfo`` records what the planner needs beyond shapes: which tensors are expert stacks,
how many experts a token visits (``num_experts_per_tok``), so that the active parameters per
token are ``total - sum(stack numel x (1 - top_k / E))``.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..optim.param_rules import is_expert_stack


@dataclass(frozen=True)
class MoEInfo:
    """The expert layout of a model: ``experts`` routed experts per MoE layer, ``top_k`` of
    them used per token, ``moe_layers`` layers with experts, ``shared_experts`` always-on
    experts per MoE layer (their weights are ordinary dense tensors)."""

    experts: int
    top_k: int
    moe_layers: int
    shared_experts: int = 0
    hidden: int = 0          # the model's width: a token's vector is this many elements


def _int(cfg: dict, *keys, default=None) -> int:
    for k in keys:
        if cfg.get(k) is not None:
            return int(cfg[k])
    if default is not None:
        return default
    raise KeyError(keys[0])


def _attention(cfg: dict, p: str, h: int, qkv_bias: bool, qk_norm: bool):
    heads = _int(cfg, "num_attention_heads")
    kv = _int(cfg, "num_key_value_heads", default=heads)
    head_dim = int(cfg.get("head_dim") or h // heads)
    out = []
    for proj, rows in (("q_proj", heads * head_dim), ("k_proj", kv * head_dim),
                       ("v_proj", kv * head_dim)):
        out.append((p + f"self_attn.{proj}.weight", (rows, h)))
        if qkv_bias:
            out.append((p + f"self_attn.{proj}.bias", (rows,)))
    out.append((p + "self_attn.o_proj.weight", (h, heads * head_dim)))
    if qk_norm:
        out += [(p + "self_attn.q_norm.weight", (head_dim,)),
                (p + "self_attn.k_norm.weight", (head_dim,))]
    return out


def _mla_attention(cfg: dict, p: str, h: int):
    """DeepSeek-V3's multi-head latent attention (q through a low-rank bottleneck when
    ``q_lora_rank`` is set; k and v always through ``kv_lora_rank``)."""
    heads = _int(cfg, "num_attention_heads")
    nope, rope = _int(cfg, "qk_nope_head_dim"), _int(cfg, "qk_rope_head_dim")
    v_dim, kv_rank = _int(cfg, "v_head_dim"), _int(cfg, "kv_lora_rank")
    q_rank = cfg.get("q_lora_rank")
    a = p + "self_attn."
    if q_rank:
        q_rank = int(q_rank)
        out = [(a + "q_a_proj.weight", (q_rank, h)), (a + "q_a_layernorm.weight", (q_rank,)),
               (a + "q_b_proj.weight", (heads * (nope + rope), q_rank))]
    else:
        out = [(a + "q_proj.weight", (heads * (nope + rope), h))]
    out += [(a + "kv_a_proj_with_mqa.weight", (kv_rank + rope, h)),
            (a + "kv_a_layernorm.weight", (kv_rank,)),
            (a + "kv_b_proj.weight", (heads * (nope + v_dim), kv_rank)),
            (a + "o_proj.weight", (h, heads * v_dim))]
    return out


def _dense_mlp(p: str, h: int, ffn: int):
    return [(p + "gate_proj.weight", (ffn, h)), (p + "up_proj.weight", (ffn, h)),
            (p + "down_proj.weight", (h, ffn))]


def _experts(p: str, h: int, ffn: int, experts: int):
    """The grouped routed experts and router of one layer, in registration order."""
    return [(p + "experts.gate_up_proj", (experts, 2 * ffn, h)),
            (p + "experts.down_proj", (experts, h, ffn))]


def _is_moe_layer(cfg: dict, i: int, family: str) -> bool:
    if family == "deepseek_v3":
        return i >= _int(cfg, "first_k_dense_replace", default=0) and \
            i % _int(cfg, "moe_layer_freq", default=1) == 0
    if family in ("qwen2_moe", "qwen3_moe"):
        if i in (cfg.get("mlp_only_layers") or []):
            return False
        step = _int(cfg, "decoder_sparse_step", default=1)
        return step > 0 and (i + 1) % step == 0
    return True


def moe_model(cfg: dict, family: str):
    """``(named shapes, tied, MoEInfo)`` of a transformers 5.x MoE model of ``family``."""
    h = _int(cfg, "hidden_size")
    layers = _int(cfg, "num_hidden_layers")
    vocab = _int(cfg, "vocab_size")
    tied = bool(cfg.get("tie_word_embeddings", False))
    if family == "mixtral":
        experts, ffn = _int(cfg, "num_local_experts"), _int(cfg, "intermediate_size")
        top_k, shared_ffn = _int(cfg, "num_experts_per_tok", default=2), 0
    elif family == "deepseek_v3":
        experts, ffn = _int(cfg, "n_routed_experts"), _int(cfg, "moe_intermediate_size")
        top_k = _int(cfg, "num_experts_per_tok")
        shared_ffn = ffn * _int(cfg, "n_shared_experts", default=0)
    else:  # qwen2_moe, qwen3_moe
        experts, ffn = _int(cfg, "num_experts"), _int(cfg, "moe_intermediate_size")
        top_k = _int(cfg, "num_experts_per_tok")
        shared_ffn = _int(cfg, "shared_expert_intermediate_size", default=0) \
            if family == "qwen2_moe" else 0
    dense_ffn = int(cfg.get("intermediate_size") or 0)
    out = [("model.embed_tokens.weight", (vocab, h))]
    moe_layers = 0
    for i in range(layers):
        p = f"model.layers.{i}."
        if family == "deepseek_v3":
            out += _mla_attention(cfg, p, h)
        else:
            out += _attention(cfg, p, h, qkv_bias=family == "qwen2_moe" or bool(
                cfg.get("attention_bias", False)), qk_norm=family == "qwen3_moe")
        m = p + "mlp."
        if not _is_moe_layer(cfg, i, family):
            out += _dense_mlp(m, h, dense_ffn)
        else:
            moe_layers += 1
            # registration order differs per family; names and shapes are what matter
            if family == "mixtral":
                out += [(m + "gate.weight", (experts, h))] + _experts(m, h, ffn, experts)
            elif family == "qwen3_moe":
                out += _experts(m, h, ffn, experts) + [(m + "gate.weight", (experts, h))]
            elif family == "qwen2_moe":
                out += [(m + "gate.weight", (experts, h))] + _experts(m, h, ffn, experts)
                if shared_ffn:
                    out += _dense_mlp(m + "shared_expert.", h, shared_ffn)
                    out.append((m + "shared_expert_gate.weight", (1, h)))
            else:  # deepseek_v3: the router's e_score_correction_bias is a buffer
                out += _experts(m, h, ffn, experts) + [(m + "gate.weight", (experts, h))]
                if shared_ffn:
                    out += _dense_mlp(m + "shared_experts.", h, shared_ffn)
        out += [(p + "input_layernorm.weight", (h,)), (p + "post_attention_layernorm.weight", (h,))]
    out.append(("model.norm.weight", (h,)))
    if not tied:
        out.append(("lm_head.weight", (vocab, h)))
    shared = 1 if family == "qwen2_moe" and shared_ffn else (
        _int(cfg, "n_shared_experts", default=0) if family == "deepseek_v3" else 0)
    return out, tied, MoEInfo(experts, top_k, moe_layers, shared, h)


MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3")


def active_params(tensors, moe: MoEInfo | None) -> int:
    """Parameters a token uses (elements): all of them, less the routed experts it skips,
    ``stack numel x (1 - top_k / experts)`` for every expert stack. The embedding table and
    the head count in full, as the model cards count them."""
    total = sum(t.numel for t in tensors)
    if moe is None:
        return total
    skipped = sum(t.numel for t in tensors if is_expert_stack(t.name, len(t.shape)))
    return total - skipped * (moe.experts - moe.top_k) // moe.experts
