"""Exercises on memory and batch optimization: peak memory, checkpointing (full and selective),
recomputation's FLOPs, the batch that fits, accumulation, KV-cache bytes.

Where torch differs by device, the details say so and the answer follows the device: AdamW is a
for-loop over the parameters on the CPU and multi-tensor (foreach) on a GPU, so the optimizer
step's temporaries differ (`step_temporaries`)."""
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
        "peak_memory", TOPICS[0], "The peak memory of one training step",
        "You train the tiny Llama-style model in fp32 with AdamW (one step, batch 1 x 8 tokens). "
        "The peak is the larger of two moments: the start of backward and the optimizer step.",
        "What is the peak memory of the step, in MiB?", "mp",
        answer=lambda s: s.expected("fp32")["peak_mem_bytes"] / MiB,
        evidence=lambda r, s: {"peak": mib(r.get("fp32", "peak_mem_bytes")),
                               "params": mib(r.get("fp32", "param_bytes")),
                               "optim": mib(r.get("fp32", "optimizer_bytes")),
                               "acts": mib(r.get("fp32", "activation_bytes")),
                               "temps": mib(step_temporaries(s)[0])},
        why="the optimizer step is the peak here: weights (4 bytes/param) + gradients (4) + AdamW's "
            "two moments (8) = 16 bytes per parameter, plus the step's temporaries ({temps} on this "
            "device): {answer}. The start of backward holds less: the gradients do not exist yet "
            "and the saved activations ({acts}) are small at 8 tokens. Measured peak {peak}: "
            "params {params}, optimizer {optim}.",
        level=2, hint="Add up what is alive at each of the two moments; the optimizer's temporaries "
                      "depend on the device's AdamW implementation (see the details).",
        mistake=lambda s: 16 * psi(s) / MiB,
        mistake_why="16 bytes per parameter counts the model states only; AdamW's step makes "
                    "temporaries on top of them, and those are the difference between devices.",
        supports=lambda r, s: within(r.get("fp32", "peak_mem_bytes"), s.expected("fp32")["peak_mem_bytes"],
                                     0.10, "the measured peak against the planner's"),
        unit="MiB", rel_tol=0.05, details=peak_details)


# --- Checkpointing ---------------------------------------------------------------------------------

def checkpoint_saving() -> Exercise:
    return Exercise(
        "checkpoint_saving", TOPICS[0], "What full activation checkpointing saves",
        "The same model (2 layers) trains on a batch of 2 x 32 tokens in fp32. You wrap every block "
        "in torch.utils.checkpoint (full recomputation): a checkpointed block keeps only its input "
        "(b x s x d x 4 bytes) and rebuilds the rest in backward. The embedding and the head (final "
        "norm, loss) are not checkpointed.",
        "How many MiB of saved activations does full checkpointing remove?", "ckpt",
        answer=lambda s: saving(s, "full"),
        evidence=lambda r, s: {"none": mib(r.get("none", "activation_bytes")),
                               "full": mib(r.get("full", "activation_bytes")),
                               "per_token": f"{block_bytes_per_token(s):,}"},
        why="each block drops its {per_token} bytes per token and keeps its input (4d bytes per "
            "token): layers x b x s x ({per_token} - 4d) = {answer}. Measured saved activations: "
            "{none} without, {full} with full recomputation (the head's log-probabilities stay).",
        level=2, hint="Per block and token: what it kept before, less what a checkpointed block still "
                      "keeps; then times the tokens and the blocks.",
        mistake=lambda s: s.cfg().model.num_layers * s.cfg().batch_size * s.cfg().seq_len
        * block_bytes_per_token(s) / MiB,
        mistake_why="a checkpointed block still keeps its input, to run its forward again in backward.",
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
        "selective_saving", TOPICS[0], "What selective checkpointing saves",
        "Same model and batch (2 layers, 2 x 32 tokens, fp32). Now every block is checkpointed "
        "selectively (torch's create_selective_checkpoint_contexts): the outputs of matmul-type ops "
        "(the linear layers and SDPA) are kept, the cheap elementwise ops (RMSNorm, RoPE, SiLU, the "
        "SwiGLU product) are recomputed in backward.",
        "How many MiB of saved activations does selective checkpointing remove?", "ckpt",
        answer=lambda s: saving(s, "selective"),
        evidence=lambda r, s: {"none": mib(r.get("none", "activation_bytes")),
                               "sel": mib(r.get("selective", "activation_bytes")),
                               "full": show(saving(s, "full"), "MiB"),
                               "kept": f"{block_bytes_per_token(s, 'selective'):,}",
                               "per_token": f"{block_bytes_per_token(s):,}",
                               "flops_none": show(r.get("none", "flops"), "FLOP"),
                               "flops_sel": show(r.get("selective", "flops"), "FLOP")},
        why="a selective block keeps 4 x (3d + 2q + 2kv + 2f) + 4 x heads = {kept} bytes per token "
            "instead of {per_token}: layers x b x s x the difference = {answer}, against {full} for "
            "full recomputation. Measured saved activations {none} plain, {sel} selective; the "
            "FLOPs stay ({flops_none} against {flops_sel}): only elementwise ops run again.",
        level=2, hint="List what a selective block keeps per token (the widths are in the details), "
                      "subtract it from what a plain block keeps, then scale by tokens and blocks.",
        mistake=lambda s: saving(s, "full"),
        mistake_why="selective keeps every matmul's output, most of a block's bytes; it saves much "
                    "less than full recomputation, which keeps only the block's input.",
        supports=lambda r, s: (within(measured_saving(r, "selective"), saving(s, "selective"), 0.10,
                                      "the measured drop in saved activations")
                               or within(r.get("selective", "flops"), r.get("none", "flops") or 0, 0.0,
                                         "selective's FLOPs against none's")),
        unit="MiB", rel_tol=0.02, details=selective_words)


def recompute_flops(s: Setup) -> int:
    return s.expected("full")["flops"] - s.expected("none")["flops"]


def recompute_cost() -> Exercise:
    return Exercise(
        "recompute_cost", TOPICS[0], "The price of recomputation",
        "Same setup (2 layers, 2 x 32 tokens): full activation checkpointing on both blocks. In "
        "backward each block's forward runs again, but torch.utils.checkpoint (non-reentrant) "
        "stops as soon as it has rebuilt the last tensor backward needs: the block's last matmul, "
        "the MLP's down-projection w2, is not re-run (no backward needs its output). Count FLOPs as "
        "FlopCounterMode does: a (m x k) @ (k x n) matmul is 2mkn; SDPA's forward is "
        "4 x b x s^2 x heads x head_dim per layer (the full score matrix).",
        "By how many percent does full recomputation raise the FLOPs of a training step?", "ckpt",
        answer=lambda s: 100 * recompute_flops(s) / s.expected("none")["flops"],
        evidence=lambda r, s: {"none": show(r.get("none", "flops"), "FLOP"),
                               "full": show(r.get("full", "flops"), "FLOP"),
                               "extra": show(recompute_flops(s), "FLOP")},
        why="per block the recomputation is 2 x b x s x (wq, wk, wv, wo, w1, w3 weights) + SDPA's "
            "4 x b x s^2 x heads x head_dim, w2 left out; both blocks: {extra}, over the plain step's "
            "FLOPs = {answer}. The embedding and the head are not recomputed and w2 is skipped, so "
            "it is well below the 33% rule of thumb. FlopCounterMode counted {none} without and "
            "{full} with recomputation.",
        level=2, hint="Count one block's forward FLOPs from its weight shapes without w2, times the "
                      "blocks, and divide by the plain step's FLOPs (in the details).",
        mistake=lambda s: 100 / 3,
        mistake_why="33% assumes one whole extra forward of the model (a step being 3 forwards); "
                    "only the blocks run again, without the embedding, the head or w2.",
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
        "fitting_batch", TOPICS[0], "The micro-batch that fits a memory budget",
        "A 1-layer model trains at seq_len 32 in fp32 with AdamW under a memory budget of 0.06 GiB "
        "(a virtual budget on the CPU, a real limit on a GPU), accumulating gradients over "
        "micro-batches. A micro-batch fits when both moments stay within the budget: the start of "
        "its backward and the optimizer step.",
        "What is the largest micro-batch that fits?", "finder",
        answer=lambda s: s.expected("fp32")["max_batch_size"],
        evidence=lambda r, s: {"found": show(r.get("fp32", "max_batch_size")),
                               "probes": show(r.get("fp32", "num_probes")),
                               "peak": mib(r.get("fp32", "peak_mem_bytes")),
                               "temps": mib(step_temporaries(s)[0])},
        why="the start of backward holds 16Ψ + b x (saved activations + the loss's 8 x s x V "
            "temporaries per sequence) + the fixed bytes; the largest b under the budget is "
            "{answer}. The optimizer step (16Ψ + {temps} of temporaries on this device) fits at any "
            "b. The finder doubled, then bisected, through real OOMs: {found} after {probes} probes "
            "(peak at that size {peak}).",
        level=3, hint="Write the backward's peak as fixed + b x per-sequence bytes and solve for b; "
                      "then check that the optimizer step fits too.",
        mistake=lambda s: no_loss_temporaries(s),
        mistake_why="at the start of backward the loss's fp32 gradients of the log-probabilities "
                    "and of the logits (8 bytes per token and vocabulary entry) sit on top of the "
                    "saved activations.",
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
        "accumulation_steps", TOPICS[0], "Gradient accumulation for an effective batch",
        "Same model and budget; the recipe asks for 36 sequences per optimizer step, in "
        "micro-batches of the largest size that fits (the previous exercise); the last micro-batch "
        "takes what is left.",
        "How many micro-batches make up one optimizer step?", "finder",
        answer=lambda s: s.expected("fp32")["accumulation_steps"],
        evidence=lambda r, s: {"found": show(r.get("fp32", "max_batch_size")),
                               "steps": show(r.get("fp32", "accumulation_steps")),
                               "micro": show(s.expected("fp32")["max_batch_size"])},
        why="ceil(effective batch / micro-batch) = ceil(36 / {micro}) = {answer}: the last "
            "micro-batch is smaller, and each loss is weighted by its share of the 36 sequences. "
            "The finder measured a largest micro-batch of {found} and planned {steps} micro-steps.",
        level=3, hint="First find the largest micro-batch (the details have every term), then "
                      "divide the effective batch by it; mind the remainder.",
        mistake=lambda s: s.cfg().effective_batch // s.expected("fp32")["max_batch_size"],
        mistake_why="rounding down drops the remainder: the step would see fewer sequences than "
                    "the recipe asks for.",
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
        "kv_cache_bytes", TOPICS[0], "The size of a KV cache",
        "A 1-layer model (2 kv heads of 64, fp32) generates 32 tokens after a 64-token prompt with a "
        "dynamic KV cache (it holds every position but the last generated one, which is never fed "
        "back).", "How many KiB does the cache hold at the end?", "kv",
        answer=lambda s: s.expected("dynamic")["kv_bytes"] / KiB,
        evidence=lambda r, s: {"kv": show(r.get("dynamic", "kv_bytes") / KiB, "KiB"),
                               "per_token": show(r.get("dynamic", "kv_bytes_per_token"), "bytes")},
        why="2 (K and V) x layers x kv heads x head_dim x bytes per value per token, times batch x "
            "positions held (prompt + new - 1): {answer}. Measured from the cache tensors' "
            "storage: {kv} ({per_token} per token).",
        level=1, hint="Bytes per token first (K and V, every layer and kv head), then the positions "
                      "the cache holds.",
        mistake=lambda s: kv_positions_bytes(s, extra=1) / KiB,
        mistake_why="the last generated token is never fed back, so its K and V are never cached.",
        supports=kv_supports, unit="KiB", rel_tol=0.005, details=kv_details)


def kv_positions_bytes(s: Setup, extra: int = 0) -> int:
    c = s.cfg("dynamic")
    positions = c.prompt_len + c.new_tokens - 1 + extra
    return planner.kv_bytes_per_token(c.model, "float32") * c.batch_size * positions


def build_exercises() -> list[Exercise]:
    return [peak_memory(), checkpoint_saving(), selective_saving(), recompute_cost(), fitting_batch(),
            accumulation_steps(), kv_cache_bytes()]
