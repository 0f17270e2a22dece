"""Exercises on memory and batch optimization: peak memory, checkpointing (full and selective),
recomputation's FLOPs, the batch that fits, accumulation, KV-cache bytes.

Where torch differs by device, the details say so and the answer follows the device: AdamW is a
for-loop over the parameters on the CPU and multi-tensor (foreach) on a GPU, so the optimizer
step's temporaries differ (`step_temporaries`).

Their words are in notebooks/exercises/text/KEY.md, one file per exercise (`text` reads them)."""
from __future__ import annotations

import math

from labkit import planner
from labkit.study.exercises.core import KiB, MiB, TOPICS, Exercise, Rows, Setup, mib, model_words, show

LOSS_TEMPORARY_BYTES = 8  # per token and vocabulary entry: fp32 grads of log-probs and of logits


def psi(s: Setup) -> int:
    return planner.num_params(s.cfg().model)


def step_temporaries(s: Setup) -> tuple[int, str]:
    """(bytes, words) of the fp32 AdamW step's temporaries on the setup's device, as the planner
    counts them: the for-loop's largest (previous + 2 x current) pair, or foreach's copy of v."""
    m = s.cfg().model
    if s.device.startswith("cuda"):
        n = 4 * psi(s)
        return n, (f"on a GPU torch's AdamW is multi-tensor (foreach): the step makes an fp32 copy "
                   f"of every moment v at once, 4 x Ψ = {n:,} bytes")
    sizes = planner.stage_tensors(m)
    prev, cur = max(zip([0] + sizes, sizes), key=lambda p: p[0] + 2 * p[1])
    n = 4 * (prev + 2 * cur)
    return n, (f"on the CPU torch's AdamW is a for-loop over the parameters: each update makes two "
               f"fp32 temporaries of its parameter's size while the previous parameter's one is "
               f"still alive, 4 x (previous + 2 x current) bytes at the largest such pair, here "
               f"4 x ({prev:,} + 2 x {cur:,}) = {n:,} bytes")


def block_bytes_per_token(s: Setup, mode: str = "none") -> int:
    """What one block keeps for backward per token (fp32), under checkpointing `mode`."""
    return planner.layer_activation_bytes(s.cfg().model, batch_size=1, seq_len=1, checkpointing=mode,
                                          device=s.device)


def shape_words(s: Setup) -> str:
    m = s.cfg().model
    return (f"d = {m.hidden_size}, heads = {m.num_heads}, head_dim = {m.head_dim}, q = heads x head_dim "
            f"= {m.num_heads * m.head_dim}, kv = kv heads x head_dim = {m.num_kv_heads * m.head_dim}, "
            f"f = {m.ffn_size} (SwiGLU: w1 and w3 d -> f, w2 f -> d)")


def plain_block_words(s: Setup) -> str:
    return (f"Without checkpointing one block keeps {block_bytes_per_token(s):,} bytes per token for "
            f"backward (fp32; the planner's count, equal to what autograd saves: two RMSNorms "
            f"2 x (4d + 4 + 8d), q, k, v and SDPA's output 4 x (2q + 2kv), SDPA's fp32 logsumexp "
            f"4 x heads, SwiGLU's four f-wide tensors 16f; {shape_words(s)}).")


def saving(s: Setup, mode: str) -> float:
    """MiB of saved activations checkpointing `mode` removes against none (the planner)."""
    return (s.expected("none")["activation_bytes"] - s.expected(mode)["activation_bytes"]) / MiB


def measured_saving(r: Rows, mode: str) -> float | None:
    none, other = r.get("none", "activation_bytes"), r.get(mode, "activation_bytes")
    return None if none is None or other is None else (none - other) / MiB


def within(measured: float | None, predicted: float, rel: float, what: str) -> str | None:
    """None when `measured` is within `rel` of `predicted`, else the sentence saying it is not."""
    if measured is not None and abs(measured - predicted) <= rel * abs(predicted):
        return None
    return f"{what}: measured {measured!r}, predicted {predicted:.6g} (allowed ±{rel:.0%})"


# --- Peak memory -----------------------------------------------------------------------------------

def peak_details(s: Setup) -> str:
    c = s.cfg()
    plan = planner.training_memory(c.model, batch_size=c.batch_size, seq_len=c.seq_len, device=s.device)
    temps, words = step_temporaries(s)
    loss = LOSS_TEMPORARY_BYTES * c.batch_size * c.seq_len * c.model.vocab_size
    return (f"{model_words(s)}\nAdamW keeps two fp32 moments (8 bytes per parameter); gradients "
            f"(4 bytes each) are allocated in backward as the activations are freed. At the start "
            f"of backward the step holds the weights, the moments, the saved activations "
            f"({plan.activation_bytes:,} bytes) and the loss's fp32 temporaries (8 x b x s x V = "
            f"{loss:,} bytes); at the optimizer step it holds weights, gradients, moments and the "
            f"step's temporaries: {words}. Device: {s.device}.")


def peak_memory() -> Exercise:
    return Exercise(
        "peak_memory", TOPICS[0], "mp",
        answer=lambda s: s.expected("fp32")["peak_mem_bytes"] / MiB,
        evidence=lambda r, s: {"peak": mib(r.get("fp32", "peak_mem_bytes")),
                               "params": mib(r.get("fp32", "param_bytes")),
                               "optim": mib(r.get("fp32", "optimizer_bytes")),
                               "acts": mib(r.get("fp32", "activation_bytes")),
                               "temps": mib(step_temporaries(s)[0])},
        level=2, mistake=lambda s: 16 * psi(s) / MiB,
        supports=lambda r, s: within(r.get("fp32", "peak_mem_bytes"), s.expected("fp32")["peak_mem_bytes"],
                                     0.10, "the measured peak against the planner's"),
        unit="MiB", rel_tol=0.05, details=peak_details)


# --- Checkpointing ---------------------------------------------------------------------------------

def checkpoint_saving() -> Exercise:
    return Exercise(
        "checkpoint_saving", TOPICS[0], "ckpt",
        answer=lambda s: saving(s, "full"),
        evidence=lambda r, s: {"none": mib(r.get("none", "activation_bytes")),
                               "full": mib(r.get("full", "activation_bytes")),
                               "per_token": f"{block_bytes_per_token(s):,}"},
        level=2, mistake=lambda s: s.cfg().model.num_layers * s.cfg().batch_size * s.cfg().seq_len
        * block_bytes_per_token(s) / MiB,
        supports=lambda r, s: within(measured_saving(r, "full"), saving(s, "full"), 0.10,
                                     "the measured drop in saved activations"),
        unit="MiB", rel_tol=0.02, details=lambda s: f"{model_words(s)}\n{plain_block_words(s)}")


def selective_words(s: Setup) -> str:
    return (f"{model_words(s)}\n{plain_block_words(s)} Selective "
            "checkpointing keeps per token: the block's input (d), the output of every matmul (wq: q, "
            "wk and wv: kv each, wo: d, w1 and w3: f each, w2: d) and SDPA's output (q), all 4 bytes "
            "per value, plus SDPA's fp32 logsumexp (4 bytes per head).")


def selective_saving() -> Exercise:
    return Exercise(
        "selective_saving", TOPICS[0], "ckpt",
        answer=lambda s: saving(s, "selective"),
        evidence=lambda r, s: {"none": mib(r.get("none", "activation_bytes")),
                               "sel": mib(r.get("selective", "activation_bytes")),
                               "full": show(saving(s, "full"), "MiB"),
                               "kept": f"{block_bytes_per_token(s, 'selective'):,}",
                               "per_token": f"{block_bytes_per_token(s):,}",
                               "flops_none": show(r.get("none", "flops"), "FLOP"),
                               "flops_sel": show(r.get("selective", "flops"), "FLOP")},
        level=2, mistake=lambda s: saving(s, "full"),
        supports=lambda r, s: (within(measured_saving(r, "selective"), saving(s, "selective"), 0.10,
                                      "the measured drop in saved activations")
                               or within(r.get("selective", "flops"), r.get("none", "flops") or 0, 0.0,
                                         "selective's FLOPs against none's")),
        unit="MiB", rel_tol=0.02, details=selective_words)


def recompute_flops(s: Setup) -> int:
    return s.expected("full")["flops"] - s.expected("none")["flops"]


def recompute_cost() -> Exercise:
    return Exercise(
        "recompute_cost", TOPICS[0], "ckpt",
        answer=lambda s: 100 * recompute_flops(s) / s.expected("none")["flops"],
        evidence=lambda r, s: {"none": show(r.get("none", "flops"), "FLOP"),
                               "full": show(r.get("full", "flops"), "FLOP"),
                               "extra": show(recompute_flops(s), "FLOP")},
        level=2, mistake=lambda s: 100 / 3,
        supports=lambda r, s: within((r.get("full", "flops") or 0) - (r.get("none", "flops") or 0),
                                     recompute_flops(s), 0.05, "the measured extra FLOPs"),
        unit="%", abs_tol=2.0,
        details=lambda s: (f"{model_words(s)} {shape_words(s)}.\nA plain training step (no checkpointing) takes "
                           f"{s.expected('none')['flops']:,} FLOP (FlopCounterMode's count)."))


# --- The batch that fits, and accumulation ---------------------------------------------------------

def budget_details(s: Setup) -> str:
    """Every term of the planner's peak at micro-batch b, per sequence and once per step."""
    c, n = s.cfg(), psi(s)
    m, budget = c.model, int(c.memory_budget_gib * 2**30)

    def acts(b: int) -> int:
        return planner.training_memory(m, batch_size=b, seq_len=c.seq_len, device=s.device,
                                       accumulation_steps=2).activation_bytes

    per_seq, loss = acts(2) - acts(1), LOSS_TEMPORARY_BYTES * c.seq_len * m.vocab_size
    _, words = step_temporaries(s)
    return (f"Model: {m.num_layers} layer, hidden {m.hidden_size}, {m.num_heads} heads ({m.num_kv_heads} "
            f"kv heads), vocabulary {m.vocab_size}, Ψ = {n:,} parameters; seq_len {c.seq_len}, fp32; "
            f"device {s.device}.\nBudget: {c.memory_budget_gib} GiB = {budget:,} bytes; micro-batches "
            f"up to {c.max_batch_size} are tried. Model states: weights 4Ψ + gradients 4Ψ (with "
            f"accumulation the earlier micro-batches' gradients are held through the backward) + "
            f"AdamW's two moments 8Ψ. At the start of a micro-batch's backward (its peak) the step "
            f"also holds the saved activations, {per_seq:,} bytes per sequence (the block's and the "
            f"head's: final norm, fp32 log-probabilities, int64 targets) plus {acts(1) - per_seq:,} "
            f"bytes once (RoPE's cos and sin tables, the loss's total_weight), and the loss's fp32 "
            f"temporaries, 8 x s x V = {loss:,} bytes per sequence. The optimizer step holds the "
            f"model states and its temporaries: {words}.")


def found_supports(r: Rows, s: Setup) -> str | None:
    """The search's measured micro-batch is the planner's within one, under the budget."""
    found, peak = r.get("fp32", "max_batch_size"), r.get("fp32", "peak_mem_bytes")
    planned, budget = s.expected("fp32")["max_batch_size"], s.cfg().memory_budget_gib * 2**30
    if found is None or abs(found - planned) > 1:
        return f"the search found a micro-batch of {found!r}, the planner {planned}"
    if peak is None or peak > budget:
        return f"the measured peak {peak!r} bytes is over the budget of {budget:.0f}"
    return None


def fitting_batch() -> Exercise:
    return Exercise(
        "fitting_batch", TOPICS[0], "finder",
        answer=lambda s: s.expected("fp32")["max_batch_size"],
        evidence=lambda r, s: {"found": show(r.get("fp32", "max_batch_size")),
                               "probes": show(r.get("fp32", "num_probes")),
                               "peak": mib(r.get("fp32", "peak_mem_bytes")),
                               "temps": mib(step_temporaries(s)[0])},
        level=3, mistake=lambda s: no_loss_temporaries(s),
        supports=found_supports, abs_tol=0.0, details=budget_details)


def no_loss_temporaries(s: Setup) -> int:
    """The largest micro-batch when the loss's backward temporaries are forgotten."""
    c, m = s.cfg(), s.cfg().model
    per_seq = [planner.training_memory(m, batch_size=b, seq_len=c.seq_len, device=s.device,
                                       accumulation_steps=2).activation_bytes for b in (1, 2)]
    room = c.memory_budget_gib * 2**30 - 16 * psi(s) - (2 * per_seq[0] - per_seq[1])
    return min(c.max_batch_size, math.floor(room / (per_seq[1] - per_seq[0])))


def accumulation_supports(r: Rows, s: Setup) -> str | None:
    found, steps = r.get("fp32", "max_batch_size"), r.get("fp32", "accumulation_steps")
    if found is None or steps != math.ceil(s.cfg().effective_batch / found):
        return f"{steps!r} micro-steps measured for a micro-batch of {found!r}"
    return found_supports(r, s)


def accumulation_steps() -> Exercise:
    return Exercise(
        "accumulation_steps", TOPICS[0], "finder",
        answer=lambda s: s.expected("fp32")["accumulation_steps"],
        evidence=lambda r, s: {"found": show(r.get("fp32", "max_batch_size")),
                               "steps": show(r.get("fp32", "accumulation_steps")),
                               "micro": show(s.expected("fp32")["max_batch_size"])},
        level=3, mistake=lambda s: s.cfg().effective_batch // s.expected("fp32")["max_batch_size"],
        supports=accumulation_supports, abs_tol=0.0, details=budget_details)


# --- Inference memory ------------------------------------------------------------------------------

def kv_details(s: Setup) -> str:
    c = s.cfg("dynamic")
    m = c.model
    return (f"Model: {m.num_layers} layer, {m.num_kv_heads} kv heads of head_dim {m.head_dim}, fp32 "
            f"(4 bytes per value); batch {c.batch_size} sequence; prompt {c.prompt_len} tokens, "
            f"{c.new_tokens} new tokens.")


def kv_supports(r: Rows, s: Setup) -> str | None:
    m = s.cfg("dynamic").model
    per_token = 2 * m.num_layers * m.num_kv_heads * m.head_dim * 4
    if r.get("dynamic", "kv_bytes_per_token") != per_token:
        return f"measured {r.get('dynamic', 'kv_bytes_per_token')!r} bytes per token, not {per_token}"
    return within(r.get("dynamic", "kv_bytes"), s.expected("dynamic")["kv_bytes"], 0.01,
                  "the measured cache bytes")


def kv_cache_bytes() -> Exercise:
    return Exercise(
        "kv_cache_bytes", TOPICS[0], "kv",
        answer=lambda s: s.expected("dynamic")["kv_bytes"] / KiB,
        evidence=lambda r, s: {"kv": show(r.get("dynamic", "kv_bytes") / KiB, "KiB"),
                               "per_token": show(r.get("dynamic", "kv_bytes_per_token"), "bytes")},
        level=1, mistake=lambda s: kv_positions_bytes(s, extra=1) / KiB,
        supports=kv_supports, unit="KiB", rel_tol=0.005, details=kv_details)


def kv_positions_bytes(s: Setup, extra: int = 0) -> int:
    c = s.cfg("dynamic")
    positions = c.prompt_len + c.new_tokens - 1 + extra
    return planner.kv_bytes_per_token(c.model, "float32") * c.batch_size * positions


def build_exercises() -> list[Exercise]:
    return [peak_memory(), checkpoint_saving(), selective_saving(), recompute_cost(), fitting_batch(),
            accumulation_steps(), kv_cache_bytes()]
