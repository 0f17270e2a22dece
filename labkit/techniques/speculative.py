"""Speculative decoding: guess several tokens cheaply, let the target check them in one forward.

- `none` (the reference): greedy decoding with a static cache, one target forward per token.
- `draft`: a small draft model proposes `num_speculative` tokens greedily with its own cache; the
  target verifies them all in ONE forward of k + 1 tokens and keeps the longest agreeing prefix
  plus its own next token; both caches are rewound past the rejected positions (gpt-fast).
- `prompt_lookup`: the proposals are the tokens that followed the latest earlier occurrence of
  the text's last `ngram` tokens (shorter n-grams tried when it has none), from the prompt and the
  text so far: no draft model. No match: a plain one-token decode step.

Decoding is batch 1 at every preset (`num_prompts` prompts one after another), the prompts the
reference language's held-out text (`labkit.blocks.reference.HELDOUT_SEED`) at every preset.

Precision. Greedy verification gives exactly greedy decoding's tokens only if a k + 1-token
forward picks the same argmax as k + 1 one-token forwards. They are different kernels (other
matmul shapes, other summation orders), so a near-tie between the top two logits can flip in
low precision. The default `dtype` is float32 on every device, where the differences (~1e-6
relative) sit far below the logit gaps, and the check is exact: token_agreement = 1 or a
failure. With `dtype` bfloat16/float16 the check is relaxed: the tokens must agree up to the
first position where the reference's top-two logit gap is below
`labkit.blocks.decoding.NEAR_TIE_LOGITS` (a near-tie that a different kernel may flip), and
token_agreement is reported. The draft's precision can never change the tokens, only the
acceptance.

On the `reference` preset the draft is the trained one (`labkit train-reference --draft`,
checksum-verified like the reference). Elsewhere the target has random weights, so a trained
draft means nothing: the draft is a random model of the draft shape with the target's vocabulary,
and its acceptance, reported as measured, is chance agreement. The mechanism still runs and is
checked (the tokens are the target's whatever the draft proposes).
The building blocks (rewindable cache, proposers, verify loop, formula) are in
`labkit.blocks.speculative`.
"""
from __future__ import annotations

import dataclasses
import statistics
import time
from dataclasses import dataclass

import torch

from labkit.config import MODELS, PRESETS, ConfigError, RunConfig, knob, torch_dtype
from labkit.blocks import reference as ref
from labkit.blocks import speculative as spec
from labkit.blocks.decoding import compare_tokens, generate_cached, load_model, top2_gaps
from labkit.blocks.model import Decoder, build_model
from labkit.workload import Comparison, SkipVariant, Workload

VARIANTS = ("none", "draft", "prompt_lookup")
REFERENCE = "none"
# smaller sizes of the default CPU run, cheapest last (labkit.harness.budget)
CPU_RUNGS = ({"new_tokens": 32}, {"new_tokens": 16, "num_layers": 2},
             {"new_tokens": 8, "prompt_len": 32, "num_layers": 2, "min_run_time_s": 0.2})

# Batch 1 everywhere (speculation pays where decoding is latency-bound); the tiny preset's random
# 4096-token model decodes fewer prompts to stay within its minute on 2 cores.
SIZES = {p: {"batch_size": 1} for p in PRESETS} | {"tiny": {"batch_size": 1, "num_prompts": 1,
                                                             "new_tokens": 64}}
PAIRED_GENERATIONS = 5  # none and the variant, alternately, for the measured speed-up
PAIRED_FORWARDS = 31  # target and proposal calls, alternately, for the cost ratio c


@dataclass(kw_only=True)
class Config(RunConfig):
    variant: str = knob(REFERENCE, choices=VARIANTS, help="proposer")
    prompt_len: int = knob(64, min=1, help="prompt tokens (held-out text of the reference language)")
    new_tokens: int = knob(128, min=1, help="tokens generated per prompt")
    num_prompts: int = knob(4, min=1, help="prompts decoded one after another (batch 1)")
    num_speculative: int = knob(4, min=1, help="tokens proposed per step (k)")
    ngram: int = knob(3, min=1, help="prompt_lookup: longest n-gram matched")
    uses_seq_len = False  # lengths come from prompt_len and new_tokens


def validate(cfg: Config) -> None:
    if cfg.batch_size != 1:
        raise ConfigError(f"batch_size={cfg.batch_size}: speculative decodes one sequence at a time "
                          "(batch_size=1; use num_prompts for more prompts)")
    if cfg.model.vocab_size < 512:
        raise ConfigError(f"vocab_size={cfg.model.vocab_size}: the prompts are the reference "
                          "language's tokens, ids up to 511; choose vocab_size >= 512")
    if cfg.prompt_len + cfg.new_tokens + cfg.num_speculative > cfg.model.max_seq_len:
        raise ConfigError(f"prompt_len + new_tokens + num_speculative exceeds the model's "
                          f"max_seq_len={cfg.model.max_seq_len}")
    if cfg.preset == "reference" and cfg.model != MODELS["reference"]:
        raise ConfigError("the reference preset loads the trained model; its shape cannot be set")


# --- models, prompts, proposers ------------------------------------------------------------------

def load_draft(cfg: Config) -> Decoder:
    """The trained draft on the `reference` preset (a skip when missing or altered); elsewhere a
    seeded random model of the draft shape with the target's vocabulary and context."""
    dtype = torch_dtype(cfg.dtype)
    if cfg.preset == "reference":
        try:
            return ref.load_reference(cfg.device, dtype, name="draft")
        except ConfigError as e:
            raise SkipVariant(str(e)) from e
    shape = dataclasses.replace(ref.SHAPES["draft"], vocab_size=cfg.model.vocab_size,
                                max_seq_len=cfg.model.max_seq_len)
    return build_model(shape, device=cfg.device, dtype=dtype, seed=cfg.seed + 2).eval()


def prompts(cfg: Config) -> torch.Tensor:
    """(num_prompts, prompt_len) held-out text of the reference language."""
    return ref.heldout(cfg.num_prompts, cfg.prompt_len).to(cfg.device)


def max_len(cfg: Config) -> int:
    return cfg.prompt_len + cfg.new_tokens + cfg.num_speculative


def make_proposer(cfg: Config) -> spec.Proposer:
    if cfg.variant == "draft":
        return spec.DraftProposer(load_draft(cfg), max_len(cfg))
    if cfg.variant == "prompt_lookup":
        return spec.PromptLookup(cfg.ngram)
    return spec.NoProposer()


def decode_all(cfg: Config, target: Decoder, texts: torch.Tensor,
               proposer: spec.Proposer) -> tuple[torch.Tensor, spec.SpecStats]:
    """Every prompt, one after another: (num_prompts, new_tokens) tokens and the pooled stats.
    `none` is plain greedy decoding with a static cache (no proposer in the loop)."""
    rows, pooled = [], spec.SpecStats()
    for prompt in texts.split(1):
        if cfg.variant == REFERENCE:
            rows.append(generate_cached(target, prompt, cfg.new_tokens,
                                        spec.make_cache(target, max_len(cfg))))
            continue
        tokens, stats = spec.generate_speculative(target, prompt, cfg.new_tokens, proposer,
                                                  cfg.num_speculative)
        rows.append(tokens)
        pooled.proposal_lens += stats.proposal_lens
        pooled.accepted += stats.accepted
    return torch.cat(rows), pooled


# --- the experiment ------------------------------------------------------------------------------

def build(cfg: Config) -> Workload:
    target, texts = load_model(cfg), prompts(cfg)
    proposer = make_proposer(cfg)
    last: dict = {}

    def step() -> torch.Tensor:
        tokens, last["stats"] = decode_all(cfg, target, texts, proposer)
        last["tokens"] = tokens
        return tokens

    def check() -> dict:
        out = {"tokens": step()}
        if cfg.variant == REFERENCE and cfg.dtype != "float32":
            out["top2_gap"] = top2_gaps(target, texts, out["tokens"])
        return out

    def report() -> dict[str, float]:
        if cfg.variant == REFERENCE:
            return {"tokens_per_step": 1.0, "speedup": 1.0}
        baseline = dataclasses.replace(cfg, variant=REFERENCE)
        none_s, mine_s = paired_medians(lambda: decode_all(baseline, target, texts, proposer),
                                        step, PAIRED_GENERATIONS, cfg.device)
        last["cost_ratio"] = cost_ratio(cfg, target, proposer, texts, last["tokens"])
        return {**stats_rows(last["stats"], cfg), "speedup": none_s / mine_s,
                "cost_ratio": last["cost_ratio"]}

    def predicted() -> dict[str, float]:
        if cfg.variant == REFERENCE:
            return {}
        return predictions(last["stats"], last["cost_ratio"], cfg)

    tokens = cfg.num_prompts * cfg.new_tokens
    return Workload(step=step, check=check, tokens_per_step=tokens, energy_tokens=tokens,
                    report=report, predicted=predicted, notes=notes(cfg), compute_dtype=cfg.dtype)


def paired_medians(first, second, repeats: int, device: str) -> tuple[float, float]:
    """Median seconds of two calls timed alternately (after one untimed call of each): on a
    shared machine a load that comes and goes then slows both alike, and their ratio holds. The
    harness times each variant's step on its own; a speed-up needs the pair side by side."""
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    times: tuple[list[float], list[float]] = ([], [])
    for i in range(repeats + 1):
        for fn, out in zip((first, second), times):
            sync()
            start = time.perf_counter()
            fn()
            sync()
            if i:
                out.append(time.perf_counter() - start)
    return statistics.median(times[0]), statistics.median(times[1])


def stats_rows(stats: spec.SpecStats, cfg: Config) -> dict[str, float]:
    proposed = stats.num_proposed
    return {"acceptance_rate": stats.num_accepted / proposed if proposed else 0.0,
            "alpha": spec.alpha_estimate(stats),
            "tokens_per_step": cfg.num_prompts * cfg.new_tokens / stats.num_steps,
            "num_target_forwards": float(stats.num_steps)}


def cost_ratio(cfg: Config, target: Decoder, proposer, texts: torch.Tensor,
               tokens: torch.Tensor) -> float:
    """c, measured: a draft's one-token decode forward over the target's (`draft`), or one
    n-gram lookup over the whole generated text over a target decode forward (`prompt_lookup`)."""
    if cfg.variant == "draft":
        proposal = decode_forward(proposer.model, texts[:1], cfg)
    else:
        seq = torch.cat([texts[-1], tokens[-1]]).tolist()[:-1]
        proposal = lambda: proposer(seq, cfg.num_speculative)  # noqa: E731
    target_s, proposal_s = paired_medians(decode_forward(target, texts[:1], cfg), proposal,
                                          PAIRED_FORWARDS, cfg.device)
    return proposal_s / target_s


def decode_forward(model: Decoder, prompt: torch.Tensor, cfg: Config):
    """A call running one decode forward (one token at position prompt_len) on a prefilled cache."""
    cache = spec.make_cache(model, max_len(cfg))
    length = prompt.shape[1]
    with torch.inference_mode():
        model(prompt, cache=cache)
    token = prompt[:, -1:]

    @torch.inference_mode()
    def call():
        model(token, start_pos=length, cache=cache, last_only=True)
        cache.rewind(length)

    return call


def predictions(stats: spec.SpecStats, c: float, cfg: Config) -> dict[str, float]:
    """Leviathan et al.'s formula at the measured alpha, averaged over the run's steps at their
    proposal lengths; the speed-up divides by each step's cost in target forwards: 1 + k c for a
    draft (k draft forwards), 1 + c for a lookup (one search per step, whatever it finds)."""
    alpha = spec.alpha_estimate(stats)
    per_step = spec.predicted_tokens_per_step(stats, alpha)
    steps = stats.proposal_lens[1:]  # the prefill proposes nothing and costs one forward
    if cfg.variant == "draft":
        cost = 1 + c * sum(steps) / stats.num_steps
    else:
        cost = 1 + c * len(steps) / stats.num_steps
    return {"tokens_per_step": per_step, "speedup": per_step / cost}


def compare(reference: dict, outputs: dict, cfg: Config) -> Comparison:
    """The reference's greedy tokens exactly (float32); below float32, exactly up to the first
    near-tie of the reference's logits (`compare_tokens`), token_agreement reported either way."""
    return compare_tokens(reference, outputs, attn_tolerance=0.0)


def expected(cfg: Config) -> dict[str, float]:
    out = {"token_agreement": 1.0}
    if cfg.variant == REFERENCE:
        out.update(tokens_per_step=1.0, speedup=1.0)
    return out


def notes(cfg: Config) -> dict[str, str]:
    if cfg.variant == REFERENCE:
        return {"tokens_per_step": "greedy decoding: one token per target forward",
                "speedup": "the reference itself"}
    draft = cfg.variant == "draft"
    random_draft = " The draft is random off the reference preset: chance agreement." \
        if draft and cfg.preset != "reference" else ""
    return {
        "acceptance_rate": "accepted / proposed guesses, over every prompt." + random_draft,
        "alpha": "accepted / judged guesses (a guess after its step's first rejection is never "
                 "judged): Leviathan et al.'s per-token acceptance probability.",
        "tokens_per_step": "generated tokens / target forwards (the prefill counts as one); "
                           "predicted: (1 - alpha^(k+1)) / (1 - alpha) at each step's own number "
                           "of guesses k, averaged (k + 1 at most).",
        "speedup": "none's time / this variant's, the same prompts timed back to back in this "
                   "process; predicted: tokens_per_step / step cost in target forwards, "
                   + ("1 + k c (k draft forwards)" if draft else "1 + c (one lookup)")
                   + ". The k + 1-token verify is taken to cost one decode forward; on a small "
                   "model it costs somewhat more, and the loop's Python per step adds to it.",
        "cost_ratio": ("c: the draft's one-token decode forward time over the target's, measured"
                       if draft else "c: one n-gram lookup over the generated text, over a "
                                     "target decode forward, measured (near 0: no model)"),
    }
