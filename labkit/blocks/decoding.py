"""Greedy decoding, as the inference experiments share it: the model they decode with
(`load_model`), generation without a KV cache (the reference) and with one, and the check of a
generation's tokens against the reference's (`compare_tokens`, exact up to a near-tie below
float32)."""
from __future__ import annotations

import torch

from labkit.blocks.model import Decoder, build_model
from labkit.config import ConfigError, RunConfig, torch_dtype
from labkit.workload import Comparison, SkipVariant


# A generation below float32 runs other kernels than its reference (a cache's one-token steps
# against a whole-prefix recompute, a k + 1 verify against k + 1 one-token forwards): other
# summation orders, which can flip a near-tie between the top two logits. bf16 keeps 8
# significant bits: logits in [8, 16) are 2^-4 = 0.0625 apart, so a gap of 4 steps is within what
# a different summation order moves through 4+ layers. Past such a flip the greedy continuations
# differ, legitimately. Used below float32 only.
NEAR_TIE_LOGITS = 0.25


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


@torch.inference_mode()
def top2_gaps(model: Decoder, prompt: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """(B, new_tokens): top-1 minus top-2 logit where each generated token was chosen (one
    teacher-forced forward of prompt + tokens), in fp32."""
    full = torch.cat([prompt, tokens], dim=1)[:, :-1]
    logits = model(full)[:, prompt.shape[1] - 1:].float()  # (B, new_tokens, vocab)
    top = logits.topk(2, dim=-1).values
    return top[..., 0] - top[..., 1]


def diverges_at_near_tie(same: torch.Tensor, gap: torch.Tensor) -> bool:
    """One sequence's tokens agree everywhere, or first differ where the reference nearly tied."""
    wrong = (~same).nonzero()
    return wrong.numel() == 0 or gap[wrong[0, 0]].item() < NEAR_TIE_LOGITS


def compare_tokens(reference: dict, outputs: dict, attn_tolerance: float) -> Comparison:
    """Lossless: greedy tokens identical to the uncached reference's, or (below float32, where
    the reference holds its `top2_gap`) identical up to each sequence's first near-tie. Lossy
    (`outputs["lossy"]`): every layer's attention output within `attn_tolerance`; token agreement
    (and perplexity delta) reported."""
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
    if not ok and "top2_gap" in reference:
        ok = all(diverges_at_near_tie(row, gap) for row, gap in zip(same, reference["top2_gap"]))
    return Comparison(metrics, ok, "" if ok else f"only {100 * agreement:.1f}% of generated tokens agree")
