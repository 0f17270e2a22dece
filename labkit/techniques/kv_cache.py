"""KV cache: greedy decoding with and without keeping each layer's keys and values.

- `none` (the reference): every new token runs the whole prefix through the model again.
- `dynamic`: the prompt is run once (prefill), its keys and values kept; each step then runs only
  the new token and appends its keys and values to the cache (by concatenation, so every step
  copies the cache: simple, and what a static or paged cache improves on).
The generated tokens must be identical: a cache changes the cost, never the answer.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from labkit import hardware, planner
from labkit.config import RunConfig, knob, torch_dtype
from labkit.model import Decoder, build_model
from labkit.workload import Comparison, Workload

VARIANTS = ("none", "dynamic")
REFERENCE = "none"


@dataclass(kw_only=True)
class Config(RunConfig):
    variant: str = knob(REFERENCE, choices=VARIANTS, help="cache strategy")
    prompt_len: int = knob(16, min=1, help="prompt tokens")
    new_tokens: int = knob(128, min=1, help="tokens generated per sequence")
    uses_seq_len = False  # lengths come from prompt_len and new_tokens


class DynamicCache:
    """Per layer, keys and values of shape (B, kv_heads, S, hd), grown along S by concatenation."""

    def __init__(self, num_layers: int):
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.keys[layer] is not None:
            k = torch.cat([self.keys[layer], k], dim=2)
            v = torch.cat([self.values[layer], v], dim=2)
        self.keys[layer], self.values[layer] = k, v
        return k, v

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in self.keys + self.values if t is not None]

    @property
    def num_tokens(self) -> int:
        """Cached positions times batch: the tokens the cache holds."""
        k = self.keys[0]
        return 0 if k is None else k.shape[0] * k.shape[2]


def next_token(logits: torch.Tensor) -> torch.Tensor:
    return logits[:, -1].argmax(dim=-1, keepdim=True)  # (B, 1), greedy


@torch.inference_mode()
def generate_uncached(model: Decoder, prompt: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """(B, P) -> (B, new_tokens); each step recomputes the prefix (logits only at its end)."""
    seq = prompt
    for _ in range(new_tokens):
        seq = torch.cat([seq, next_token(model(seq, last_only=True))], dim=1)
    return seq[:, prompt.shape[1]:]


@torch.inference_mode()
def generate_cached(model: Decoder, prompt: torch.Tensor, new_tokens: int, cache) -> torch.Tensor:
    """(B, P) -> (B, new_tokens): prefill once, then one token per step against the cache."""
    token = next_token(model(prompt, cache=cache, last_only=True))
    out = [token]
    for i in range(new_tokens - 1):
        token = next_token(model(token, start_pos=prompt.shape[1] + i, cache=cache, last_only=True))
        out.append(token)
    return torch.cat(out, dim=1)


def build(cfg: Config) -> Workload:
    model = build_model(cfg.model, device=cfg.device, dtype=torch_dtype(cfg.dtype), seed=cfg.seed,
                        attention=cfg.attention).eval()
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    prompt = torch.randint(0, cfg.model.vocab_size, (cfg.batch_size, cfg.prompt_len), generator=gen)
    prompt = prompt.to(cfg.device)
    last = {}  # the latest generation's cache, measured after the memory step

    def step() -> torch.Tensor:
        if cfg.variant == "none":
            return generate_uncached(model, prompt, cfg.new_tokens)
        last["cache"] = DynamicCache(cfg.model.num_layers)
        return generate_cached(model, prompt, cfg.new_tokens, last["cache"])

    cached = cfg.variant != "none"
    return Workload(
        step=step, check=lambda: {"tokens": step()},
        tokens_per_step=cfg.batch_size * cfg.new_tokens,
        tensors={"kv_bytes": lambda: last["cache"].tensors()} if cached else {},
        per_token={"kv_bytes": lambda: last["cache"].num_tokens} if cached else {},
        notes=notes(cfg), compute_dtype=cfg.dtype)


def compare(reference: dict, outputs: dict, cfg: Config) -> Comparison:
    """Greedy tokens must be identical to the uncached reference's."""
    agreement = (reference["tokens"] == outputs["tokens"]).float().mean().item()
    ok = agreement == 1.0
    message = "" if ok else f"only {100 * agreement:.1f}% of generated tokens agree"
    return Comparison({"token_agreement": agreement}, ok, message)


def expected(cfg: Config) -> dict[str, float]:
    m, cached = cfg.model, cfg.variant != "none"
    flops = planner.generate_flops(m, batch=cfg.batch_size, prompt_len=cfg.prompt_len,
                                   new_tokens=cfg.new_tokens, cached=cached)
    out: dict[str, float] = {"flops": flops, "token_agreement": 1.0}
    ceil = hardware.ceilings(cfg.device, num_threads=cfg.num_threads)
    peak = ceil.peak_tflops.get(cfg.dtype)
    if peak and ceil.bandwidth_gbps:
        # Every forward pass reads all weights once: each step is bound by FLOPs or by bytes.
        weight_s = planner.param_bytes(m, cfg.dtype) / (ceil.bandwidth_gbps * 1e9) * cfg.new_tokens
        seconds = max(flops / (peak * 1e12), weight_s)
        out.update(tflops=peak, tokens_per_s=cfg.batch_size * cfg.new_tokens / seconds)
    if cached:
        per_token = planner.kv_bytes_per_token(m, cfg.dtype)
        held = cfg.batch_size * (cfg.prompt_len + cfg.new_tokens - 1)  # the last token is never fed back
        out.update(kv_bytes_per_token=per_token, kv_bytes=per_token * held)
    return out


def notes(cfg: Config) -> dict[str, str]:
    out = {"tokens_per_s": "predicted: the slower of FLOPs at peak and reading every weight once per "
                           "forward pass at the device's bandwidth (an upper bound); a small model "
                           "falls short of it on per-step overhead."}
    if cfg.variant != "none":
        out["kv_bytes_per_token"] = ("2 (K and V) x layers x kv_heads x head_dim x bytes per "
                                     "element; grouped-query attention divides it by "
                                     "heads / kv_heads.")
    return out
