"""Greedy decoding, as the inference experiments share it: the model they decode with
(`load_model`), generation without a KV cache (the reference) and with one, and the check of a
generation's tokens against the reference's (`compare_tokens`)."""
from __future__ import annotations

import torch

from labkit.blocks.model import Decoder, build_model
from labkit.config import ConfigError, RunConfig, torch_dtype
from labkit.workload import Comparison, SkipVariant


def load_model(cfg: RunConfig) -> Decoder:
    """On the `reference` preset the trained model (a skip when its weights are missing or
    altered); otherwise the preset's shape with seeded random weights. In eval mode."""
    if cfg.preset == "reference":
        from labkit.blocks import reference  # its weights are trained by `labkit train-reference`

        try:
            return reference.load_reference(device=cfg.device, dtype=torch_dtype(cfg.dtype)).eval()
        except ConfigError as e:
            raise SkipVariant(str(e)) from e
    return build_model(cfg.model, device=cfg.device, dtype=torch_dtype(cfg.dtype), seed=cfg.seed,
                       attention=cfg.attention).eval()


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


def compare_tokens(reference: dict, outputs: dict, attn_tolerance: float) -> Comparison:
    """Lossless: greedy tokens identical to the uncached reference's. Lossy (`outputs["lossy"]`):
    every layer's attention output within `attn_tolerance`; token agreement (and perplexity delta)
    reported."""
    same = reference["tokens"] == outputs["tokens"]
    agreement = same.sum().item() / same.numel()  # counted exactly (a CUDA mean can round 1 down)
    metrics = {"token_agreement": agreement}
    if "attn_output_rel_error" in outputs:
        metrics["attn_output_rel_error"] = outputs["attn_output_rel_error"]
    if "perplexity" in outputs and "perplexity" in reference:
        metrics["perplexity_delta"] = outputs["perplexity"] - reference["perplexity"]
    if outputs.get("lossy"):
        error = outputs["attn_output_rel_error"]
        ok = error <= attn_tolerance
        return Comparison(metrics, ok, "" if ok else f"attention output off by {100 * error:.2f}% "
                                                     f"(tolerance {100 * attn_tolerance:.0f}%)")
    ok = agreement == 1.0
    return Comparison(metrics, ok, "" if ok else f"only {100 * agreement:.1f}% of generated tokens agree")
