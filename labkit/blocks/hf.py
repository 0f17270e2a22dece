"""Hugging Face causal LMs on labkit's own decoder: a `config.json` read as a ModelConfig, and
the weights mapped both ways.

The design: the Hugging Face model is mapped onto `labkit.blocks.model.Decoder`, not run as
the transformers module. So the transforms, the planner and the tensor-parallel plan, which
all know that decoder, apply unchanged, and the core needs no transformers. The mapping is
claimed exact, and tests/test_hf.py holds it to transformers' logits, parameter count, cache
bytes and greedy tokens. Llama, Mistral and Qwen2 are the Llama-style decoder (Qwen2 with q, k, v
biases); GPT-2 is the GPT-2-style one, its Conv1D weights transposed. Mixtral and Qwen2-MoE are
the Llama-style decoder with mixture-of-experts MLPs (`labkit.blocks.moe`: dropless, as
transformers runs them; Qwen2-MoE with its gated shared expert), their weights in transformers
5's layout (each layer's experts stacked, gate and up fused). What the decoder cannot reproduce
exactly is refused with one line.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from labkit.config import ConfigError, ModelConfig

SUPPORTED = ("llama", "mistral", "qwen2", "gpt2", "mixtral", "qwen2_moe")
MOE = ("mixtral", "qwen2_moe")
ROPE_TYPES = ("default", "llama3")
GPT2_ACTIVATIONS = ("gelu_new", "gelu_pytorch_tanh")  # the tanh approximation labkit computes
# transformers' defaults where a config.json leaves a field out (its configuration classes).
CONTEXT_DEFAULT = {"llama": 2048, "mistral": 4096 * 32, "qwen2": 32768, "mixtral": 4096 * 32,
                   "qwen2_moe": 32768}
EPS_DEFAULT = {"mixtral": 1e-5}  # others 1e-6
THETA_DEFAULT = {"mixtral": 1e6}  # others 10000
MISTRAL_WINDOW_DEFAULT = 4096


def read_config(folder: str | Path) -> dict[str, Any]:
    """The folder's config.json as a dict; a missing folder or file, or bad JSON: one line."""
    path = Path(folder) / "config.json"
    if not Path(folder).is_dir():
        raise ConfigError(f"--hf-model {folder}: no such folder; give a folder holding config.json")
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"--hf-model {folder}: no config.json in it") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"--hf-model {path}: not a readable JSON file ({e})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"--hf-model {path}: expected a JSON object")
    return raw


def model_config(folder: str | Path) -> ModelConfig:
    """The ModelConfig of the folder's config.json (`source` = the folder, so build_model loads
    its safetensors weights while the shape stays the folder's own)."""
    raw = read_config(folder)
    kind = raw.get("model_type")
    if kind not in SUPPORTED:
        raise ConfigError(f"model_type {kind!r} is not supported; valid: {', '.join(SUPPORTED)}")
    shape = _gpt2_shape(raw) if kind == "gpt2" else _llama_shape(raw, kind)
    cfg = ModelConfig(**shape, source=str(Path(folder).resolve()))
    if cfg.hidden_size % cfg.num_heads or cfg.num_heads % cfg.num_kv_heads:
        raise ConfigError(f"{kind}: hidden size {cfg.hidden_size}, {cfg.num_heads} heads and "
                          f"{cfg.num_kv_heads} kv heads do not divide evenly")
    return cfg


def _need(raw: dict, kind: str, *names: str) -> list[Any]:
    missing = [n for n in names if not isinstance(raw.get(n), int) or isinstance(raw.get(n), bool)]
    if missing:
        raise ConfigError(f"{kind} config.json: {', '.join(missing)} missing or not a whole number")
    return [raw[n] for n in names]


def _refuse(kind: str, what: str, supported: str) -> None:
    raise ConfigError(f"{kind}: {what} is not supported by labkit's decoder; supported: {supported}")


def _llama_shape(raw: dict, kind: str) -> dict[str, Any]:
    """Llama, Mistral, Qwen2: RMSNorm, RoPE, grouped-query attention, SwiGLU."""
    d, f, layers, heads, vocab = _need(raw, kind, "hidden_size", "intermediate_size",
                                       "num_hidden_layers", "num_attention_heads", "vocab_size")
    if raw.get("hidden_act", "silu") != "silu":
        _refuse(kind, f"hidden_act={raw['hidden_act']!r}", "silu")
    if raw.get("attention_bias") or raw.get("mlp_bias"):
        _refuse(kind, "attention_bias / mlp_bias", "no biases (Qwen2: q, k, v biases)")
    if raw.get("head_dim") not in (None, d // heads):
        _refuse(kind, f"head_dim={raw['head_dim']} (not hidden_size / heads)", f"head_dim={d // heads}")
    theta, llama3 = _rope(raw, kind)
    context = raw.get("max_position_embeddings", CONTEXT_DEFAULT[kind])
    window = _sliding_window(raw, kind)
    return dict(arch="llama", num_layers=layers, hidden_size=d, num_heads=heads,
                num_kv_heads=raw.get("num_key_value_heads") or heads, ffn_size=f, vocab_size=vocab,
                max_seq_len=min(context, window or context), rope_theta=float(theta),
                norm_eps=float(raw.get("rms_norm_eps", EPS_DEFAULT.get(kind, 1e-6))),
                tie_embeddings=bool(raw.get("tie_word_embeddings", False)),
                qkv_bias=kind == "qwen2" or (kind == "qwen2_moe" and bool(raw.get("qkv_bias", True))),
                rope_llama3=llama3, **(_moe_shape(raw, kind) if kind in MOE else {}))


def _moe_shape(raw: dict, kind: str) -> dict[str, Any]:
    """Mixtral's and Qwen2-MoE's experts, transformers' defaults where a field is left out.
    Dropless (capacity_factor 0), as transformers computes them."""
    if kind == "mixtral":
        if raw.get("router_jitter_noise", 0.0):
            _refuse(kind, "router_jitter_noise", "0")
        return dict(num_experts=raw.get("num_local_experts", 8), experts_per_token=raw.get("num_experts_per_tok", 2),
                    moe_ffn_size=raw["intermediate_size"], norm_topk_prob=True,
                    router_aux_loss_coef=float(raw.get("router_aux_loss_coef", 0.001)))
    if raw.get("decoder_sparse_step", 1) != 1 or raw.get("mlp_only_layers"):
        _refuse(kind, "dense layers among the MoE ones (decoder_sparse_step, mlp_only_layers)",
                "decoder_sparse_step=1, mlp_only_layers=[]")
    if raw.get("shared_expert_intermediate_size", 5632) < 1:
        _refuse(kind, "no shared expert", "shared_expert_intermediate_size > 0")
    return dict(num_experts=raw.get("num_experts", 60), experts_per_token=raw.get("num_experts_per_tok", 4),
                moe_ffn_size=raw.get("moe_intermediate_size", 1408),
                shared_expert_ffn_size=raw.get("shared_expert_intermediate_size", 5632),
                norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
                router_aux_loss_coef=float(raw.get("router_aux_loss_coef", 0.001)))


def _sliding_window(raw: dict, kind: str) -> int | None:
    """The attention window, or None. Within it sliding-window attention is full causal
    attention, so the context is capped at the window: a longer run is refused by resolve()
    instead of computed wrongly."""
    if kind == "mistral":
        return raw.get("sliding_window", MISTRAL_WINDOW_DEFAULT)
    if kind == "mixtral":
        return raw.get("sliding_window")
    if kind in ("qwen2", "qwen2_moe") and raw.get("use_sliding_window"):
        return raw.get("sliding_window", 4096)
    return None


def _rope(raw: dict, kind: str) -> tuple[float, tuple[float, float, float, int] | None]:
    """(theta, Llama 3 scaling or None) from `rope_parameters` (transformers 5) or `rope_theta`
    and `rope_scaling` (older files)."""
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if not isinstance(params, dict) or any(isinstance(v, dict) for v in params.values()):
        _refuse(kind, "per-layer RoPE parameters", "one rope_parameters object")
    theta = params.get("rope_theta", raw.get("rope_theta", THETA_DEFAULT.get(kind, 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        _refuse(kind, f"rope scaling {rope_type!r}", ", ".join(ROPE_TYPES))
    if params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)) != 1.0:
        _refuse(kind, "partial_rotary_factor", "1.0")
    if rope_type == "default":
        return theta, None
    original = params.get("original_max_position_embeddings", raw.get("max_position_embeddings"))
    return theta, (float(params["factor"]), float(params["low_freq_factor"]),
                   float(params["high_freq_factor"]), int(original))


def _gpt2_shape(raw: dict) -> dict[str, Any]:
    """GPT-2: learned positions, LayerNorm with biases, tanh GELU, tied embeddings by default."""
    d, layers, heads, vocab, context = _need(raw, "gpt2", "n_embd", "n_layer", "n_head",
                                             "vocab_size", "n_positions")
    if raw.get("activation_function", "gelu_new") not in GPT2_ACTIVATIONS:
        _refuse("gpt2", f"activation_function={raw['activation_function']!r}", ", ".join(GPT2_ACTIVATIONS))
    for name, wanted in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                         ("reorder_and_upcast_attn", False), ("add_cross_attention", False)):
        if raw.get(name, wanted) != wanted:
            _refuse("gpt2", f"{name}={raw[name]}", f"{name}={wanted}")
    return dict(arch="gpt2", num_layers=layers, hidden_size=d, num_heads=heads, num_kv_heads=heads,
                ffn_size=raw.get("n_inner") or 4 * d, vocab_size=vocab, max_seq_len=context,
                norm_eps=float(raw.get("layer_norm_epsilon", 1e-5)),
                tie_embeddings=bool(raw.get("tie_word_embeddings", True)))


def config_dict(cfg: ModelConfig) -> dict[str, Any]:
    """The config.json transformers builds the same model from (`model_config`'s inverse):
    `llama` for a Llama-style shape (`qwen2` with q, k, v biases), `gpt2` for a GPT-2 one."""
    if cfg.arch == "gpt2":
        return {"model_type": "gpt2", "n_embd": cfg.hidden_size, "n_layer": cfg.num_layers,
                "n_head": cfg.num_heads, "n_inner": cfg.ffn_size, "vocab_size": cfg.vocab_size,
                "n_positions": cfg.max_seq_len, "layer_norm_epsilon": cfg.norm_eps,
                "tie_word_embeddings": cfg.tie_embeddings, "activation_function": "gelu_new"}
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_llama3:
        factor, low, high, original = cfg.rope_llama3
        rope.update(rope_type="llama3", factor=factor, low_freq_factor=low, high_freq_factor=high,
                    original_max_position_embeddings=original)
    out = {"model_type": "qwen2" if cfg.qkv_bias else "llama", "hidden_size": cfg.hidden_size,
           "intermediate_size": cfg.ffn_size, "num_hidden_layers": cfg.num_layers,
           "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
           "vocab_size": cfg.vocab_size, "max_position_embeddings": cfg.max_seq_len,
           "rms_norm_eps": cfg.norm_eps, "tie_word_embeddings": cfg.tie_embeddings,
           "hidden_act": "silu", "rope_theta": cfg.rope_theta, "rope_parameters": rope}
    return out if not cfg.num_experts else {**out, **_moe_dict(cfg)}


def _moe_dict(cfg: ModelConfig) -> dict[str, Any]:
    """An MoE shape's fields: `mixtral` (renormalised top-k, no shared expert, no biases), else
    `qwen2_moe`. transformers' MoE blocks are dropless: capacity_factor is not written."""
    common = {"num_experts_per_tok": cfg.experts_per_token, "router_aux_loss_coef": cfg.router_aux_loss_coef}
    if cfg.norm_topk_prob and not cfg.shared_expert_ffn_size and not cfg.qkv_bias:
        return {**common, "model_type": "mixtral", "num_local_experts": cfg.num_experts,
                "intermediate_size": cfg.expert_ffn_size}
    return {**common, "model_type": "qwen2_moe", "num_experts": cfg.num_experts,
            "moe_intermediate_size": cfg.expert_ffn_size, "qkv_bias": cfg.qkv_bias,
            "shared_expert_intermediate_size": cfg.shared_expert_ffn_size,
            "norm_topk_prob": cfg.norm_topk_prob, "decoder_sparse_step": 1, "mlp_only_layers": []}


# --- names: labkit's parameter <-> transformers' -------------------------------------------------

LLAMA_NAMES = {  # per block: labkit -> transformers, below model.layers.{i}.
    "attn_norm.weight": "input_layernorm.weight", "mlp_norm.weight": "post_attention_layernorm.weight",
    "attn.wq.weight": "self_attn.q_proj.weight", "attn.wk.weight": "self_attn.k_proj.weight",
    "attn.wv.weight": "self_attn.v_proj.weight", "attn.wo.weight": "self_attn.o_proj.weight",
    "attn.wq.bias": "self_attn.q_proj.bias", "attn.wk.bias": "self_attn.k_proj.bias",
    "attn.wv.bias": "self_attn.v_proj.bias",
    "mlp.w1.weight": "mlp.gate_proj.weight", "mlp.w3.weight": "mlp.up_proj.weight",
    "mlp.w2.weight": "mlp.down_proj.weight"}
GPT2_NAMES = {  # per block, below transformer.h.{i}.; Conv1D weights are (in, out): transposed
    "attn_norm.weight": "ln_1.weight", "attn_norm.bias": "ln_1.bias",
    "mlp_norm.weight": "ln_2.weight", "mlp_norm.bias": "ln_2.bias",
    "attn.wo.weight": "attn.c_proj.weight", "attn.wo.bias": "attn.c_proj.bias",
    "mlp.w1.weight": "mlp.c_fc.weight", "mlp.w1.bias": "mlp.c_fc.bias",
    "mlp.w2.weight": "mlp.c_proj.weight", "mlp.w2.bias": "mlp.c_proj.bias"}
MOE_NAMES = {  # per block, an MoE's tensors mapped one to one (gate_up_proj is [w1; w3], fused)
    "mlp.router.weight": "mlp.gate.weight", "mlp.experts.w2": "mlp.experts.down_proj",
    "mlp.shared.w1.weight": "mlp.shared_expert.gate_proj.weight",
    "mlp.shared.w3.weight": "mlp.shared_expert.up_proj.weight",
    "mlp.shared.w2.weight": "mlp.shared_expert.down_proj.weight",
    "mlp.shared_gate.weight": "mlp.shared_expert_gate.weight"}
TOP_NAMES = {"llama": {"embed.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
                       "lm_head.weight": "lm_head.weight"},
             "gpt2": {"embed.weight": "transformer.wte.weight", "pos_embed.weight": "transformer.wpe.weight",
                      "norm.weight": "transformer.ln_f.weight", "norm.bias": "transformer.ln_f.bias",
                      "lm_head.weight": "lm_head.weight"}}


def name_map(cfg: ModelConfig) -> dict[str, str]:
    """labkit name -> transformers name for every tensor mapped one to one (GPT-2's fused c_attn
    is split and joined by `to_hf` / `from_hf`)."""
    per_block, prefix = (GPT2_NAMES, "transformer.h") if cfg.arch == "gpt2" else (LLAMA_NAMES, "model.layers")
    if cfg.arch == "llama" and not cfg.qkv_bias:
        per_block = {k: v for k, v in per_block.items() if not k.endswith("bias")}
    if cfg.num_experts:
        moe = {k: v for k, v in MOE_NAMES.items() if cfg.shared_expert_ffn_size or ".shared" not in k}
        per_block = {**{k: v for k, v in per_block.items() if not k.startswith("mlp.")}, **moe}
    names = dict(TOP_NAMES[cfg.arch])
    for i in range(cfg.num_layers):
        names.update({f"layers.{i}.{k}": f"{prefix}.{i}.{v}" for k, v in per_block.items()})
    return names


def _transposed(cfg: ModelConfig, labkit_name: str) -> bool:
    """GPT-2's Conv1D keeps (in, out) weights; nn.Linear keeps (out, in)."""
    return cfg.arch == "gpt2" and labkit_name.endswith(("wo.weight", "w1.weight", "w2.weight"))


def to_hf(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """A labkit state dict in transformers' names and layouts (load it into the transformers
    model of the same config with load_state_dict)."""
    out = {}
    for ours, theirs in name_map(cfg).items():
        out[theirs] = state[ours].t() if _transposed(cfg, ours) else state[ours]
    for i in range(cfg.num_layers if cfg.arch == "gpt2" else 0):
        for kind in ("weight", "bias"):  # c_attn = [q; k; v], (d, 3d) as a Conv1D
            fused = torch.cat([state[f"layers.{i}.attn.w{p}.{kind}"] for p in "qkv"])
            out[f"transformer.h.{i}.attn.c_attn.{kind}"] = fused.t() if kind == "weight" else fused
    for i in range(cfg.num_layers if cfg.num_experts else 0):  # (E, 2f, d): gate rows, then up
        experts = f"layers.{i}.mlp.experts"
        out[_gate_up(i)] = torch.cat([state[f"{experts}.w1"], state[f"{experts}.w3"]], dim=1)
    return {k: v.contiguous() for k, v in out.items()}


def _gate_up(layer: int) -> str:
    return f"model.layers.{layer}.mlp.experts.gate_up_proj"


def from_hf(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """A transformers state dict (or safetensors file) in labkit's names. Checkpoints saved
    without the `transformer.` prefix (the original GPT-2 files) are accepted; a tied head
    absent from the file is the embedding. Missing tensors: one ConfigError line."""
    state = dict(state)
    if cfg.arch == "gpt2" and "transformer.wte.weight" not in state:
        state = {f"transformer.{k}" if not k.startswith("lm_head") else k: v for k, v in state.items()}
    if cfg.tie_embeddings:
        state.setdefault("lm_head.weight", state.get(TOP_NAMES[cfg.arch]["embed.weight"]))
    names = name_map(cfg)
    fused = [f"transformer.h.{i}.attn.c_attn.{k}" for i in range(cfg.num_layers if cfg.arch == "gpt2" else 0)
             for k in ("weight", "bias")]
    gate_up = [_gate_up(i) for i in range(cfg.num_layers if cfg.num_experts else 0)]
    missing = [n for n in [*names.values(), *fused, *gate_up] if state.get(n) is None]
    if missing:
        raise ConfigError(f"the weights lack {len(missing)} of this config's tensors, e.g. {missing[0]}")
    out = {ours: state[theirs].t() if _transposed(cfg, ours) else state[theirs]
           for ours, theirs in names.items()}
    for name in fused:
        i, kind = name.split(".")[2], name.rsplit(".", 1)[1]
        tensor = state[name].t() if kind == "weight" else state[name]
        for p, part in zip("qkv", tensor.chunk(3, dim=0)):
            out[f"layers.{i}.attn.w{p}.{kind}"] = part
    for i, name in enumerate(gate_up):
        out[f"layers.{i}.mlp.experts.w1"], out[f"layers.{i}.mlp.experts.w3"] = state[name].chunk(2, dim=1)
    return {k: v.contiguous() for k, v in out.items()}


# --- the folder's weights -------------------------------------------------------------------------

def weight_files(folder: str | Path) -> list[Path]:
    """The folder's safetensors files (one, or the shards of a sharded checkpoint)."""
    return sorted(Path(folder).glob("*.safetensors"))


def load_weights(model: torch.nn.Module, folder: str | Path) -> torch.nn.Module:
    """Copy the folder's safetensors weights (transformers' names) into `model` (a
    `labkit.blocks.model.Decoder`), in place."""
    from safetensors.torch import load_file

    files = weight_files(folder)
    if not files:
        raise ConfigError(f"{folder}: no .safetensors weights in it")
    state: dict[str, torch.Tensor] = {}
    for path in files:
        state.update(load_file(str(path)))
    ours = from_hf(state, model.cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():  # tied: the head is the embedding, copied once
            p.copy_(ours[name])
    return model


def loads_weights(cfg) -> bool:
    """Whether a model of shape `cfg` gets its folder's weights: the folder has some and the
    shape is the folder's own (a shape shrunk through --set keeps its random weights)."""
    return bool(cfg.source) and bool(weight_files(cfg.source)) and model_config(cfg.source) == cfg


def maybe_load_weights(model: torch.nn.Module) -> bool:
    """Load `model.cfg.source`'s weights when `loads_weights`. True when loaded."""
    if not loads_weights(model.cfg):
        return False
    load_weights(model, model.cfg.source)
    return True
