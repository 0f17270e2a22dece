"""Exercises on recipes: several techniques on one training step (`labkit.techniques.recipe`).

The peak and the ladder share one Run ("recipe"): bf16 on two CPU ranks over gloo at the ladder's four rungs (DDP
with autocast, then full checkpointing, 2 micro-batches and ZeRO-2 added one at a time; under
ZeRO-2, FSDP2's bf16 mixed-precision policy in place of autocast), each composed recipe under a
virtual budget. The Run pins device "cpu" (one GPU cannot hold two NCCL ranks), so every answer
is the same for "cpu" and "cuda": per-rank bytes do not depend on it.

The peak exercise is predicted from the planner's terms (`recipe.planned`, the prediction each
measured row carries); the ladder's reference is the first rung whose planned peak fits the budget,
and the measurement shows it: every earlier rung is an `oom` row on every rank. The chunked loss's
exercise has its own Run ("chunked": one process, the plain loss and `loss=chunked`): the
activations it takes off are the planner's, and the measured rows hold them exactly.

Their words are in notebooks/exercises/text/KEY.md, one file per exercise (`text` reads them)."""
from __future__ import annotations

import math

from labkit import planner
from labkit.study.exercises.core import MiB, TOPICS, Exercise, Rows, Setup, mib, show
from labkit.study.exercises.inference import measured_is
from labkit.study.exercises.runs import RECIPE_RUNGS as RUNGS  # the ladder: the Run's points
from labkit.techniques import recipe

VARIANT = "composed"
DIST_WORDS = ("Measured on two CPU processes over gloo on any machine, a GPU's included: the "
              "answer (per-rank bytes) does not depend on the device.")
NONE = "none of them"
TOP = RUNGS["+ ZeRO-2"]  # the peak exercise's recipe: bf16 + full + 2 micro-batches + ZeRO-2


def plan(s: Setup, point: dict) -> planner.MemoryPlan:
    return recipe.planned(s.cfg(VARIANT, **point))


def budget_bytes(s: Setup) -> int:
    return int(s.cfg().budget_gib * 2**30)


def shape(s: Setup, point: dict) -> dict[str, int]:
    """The numbers the terms are written in: Ψ, one micro-batch's b, s, V, d, ranks N."""
    c = s.cfg(VARIANT, **point)
    m = c.model
    return {"psi": planner.num_params(m), "b": c.batch_size // c.micro_batches, "s": c.seq_len,
            "V": m.vocab_size, "d": m.hidden_size, "N": c.nproc, "L": m.num_layers}


def all_casts(s: Setup) -> int:
    """autocast's bf16 copies of every matmul weight (cached until the forward ends): per block
    wq, wk, wv, wo and SwiGLU's w1, w3, w2, plus the head's V x d, 2 bytes each."""
    m = s.cfg().model
    q, kv = m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim
    block = 2 * m.hidden_size * q + 2 * m.hidden_size * kv + 3 * m.hidden_size * m.ffn_size
    return 2 * (m.num_layers * block + m.vocab_size * m.hidden_size)


def moments(s: Setup, point: dict) -> dict[str, dict[str, int]]:
    """What each moment of one step holds on a rank, term by term (bytes), by the rules the
    details state; the tests hold the sums to the planner's phases."""
    p, n = plan(s, point), shape(s, point)
    accumulating = point["micro_batches"] > 1
    states = {"weights": p.param_bytes, "moments": p.optimizer_bytes}
    step = {**states, "grads": p.grad_bytes,
            "temporaries": p.phase_bytes["step"] - sum(states.values()) - p.grad_bytes}
    if point["zero_stage"] == 2:
        # FSDP2's ZeRO-2 under its bf16 policy: fp32 shards at rest, the whole weights gathered
        # in bf16 from each unit's forward to its backward, no autocast casts. Each micro-batch's
        # backward makes whole gradients anew, largest in the first block it goes through; after
        # it, the root unit's reduce-scatter: the details print the planner's figure for both.
        held = {**states, "gathered": p.gathered_bytes}
        held.update({"grad shards": p.grad_bytes} if accumulating else {})
        backward = p.phase_bytes["backward"] - sum(held.values()) - p.activation_bytes
        reduce = p.phase_bytes["reduce"] - sum(states.values()) - p.grad_bytes
        return {"backward": {**held, "activations": p.activation_bytes, "temporaries": backward},
                "reduce": {**states, "grad shards": p.grad_bytes, "temporaries": reduce},
                "step": step}
    # DDP with autocast: buckets for the model's life, .grad of earlier micro-batches beside
    # them; every cast cached to the forward's end, the backward's kept; at the backward's start
    # the loss's fp32 gradients 8·b·s·V
    held = {**states, "buckets": p.grad_bytes}
    held.update({"accumulated grads": p.grad_bytes} if accumulating else {})
    return {"forward": {**held, "activations": p.activation_bytes, "casts": all_casts(s),
                        "temporaries": 6 * n["b"] * n["s"] * n["V"]},
            "backward": {**held, "activations": p.activation_bytes,
                         "casts": p.kept_weight_copy_bytes,
                         "temporaries": 8 * n["b"] * n["s"] * n["V"]},
            "step": step}


MOMENT_WORDS = {"forward": "end of the second micro-batch's forward",
                "backward": "largest moment of its backward",
                "reduce": "root unit's reduce-scatter after the backward", "step": "optimizer step"}


def peak_of(s: Setup, point: dict) -> int:
    return plan(s, point).total_bytes


# --- The peak of a recipe ---------------------------------------------------------------------------

def peak_details(s: Setup) -> str:
    n, p = shape(s, TOP), plan(s, TOP)
    t = moments(s, TOP)
    return (
        f"Model: {n['L']} layers, hidden d = {n['d']}, vocabulary V = {n['V']}, Ψ = {n['psi']:,} "
        f"parameters; each rank's batch of {s.cfg().batch_size} sequences of s = {n['s']} tokens "
        f"runs as 2 micro-batches of b = {n['b']}; N = {n['N']} ranks. {DIST_WORDS}\n"
        f"Under ZeRO-2 (FSDP2), bf16 is FSDP2's mixed-precision policy, not autocast: the shards, "
        f"their gradients and AdamW stay fp32; each unit is gathered in bf16 and its forward and "
        f"backward run in bf16. The planner's terms, per rank, in bytes:\n"
        f"- fp32 weight shard at rest, 4Ψ/N: {p.param_bytes:,}; FSDP2's ZeRO-2 does not reshard "
        f"after the forward, so the whole weights, gathered in bf16, 2Ψ: {p.gathered_bytes:,}, "
        f"stay from each unit's forward to its backward;\n"
        f"- AdamW's two fp32 moments, sharded, 8Ψ/N: {p.optimizer_bytes:,};\n"
        f"- fp32 gradient shards, 4Ψ/N: {p.grad_bytes:,} (reduce-scattered in fp32; the first "
        f"micro-batch's are held through the second's forward and backward);\n"
        f"- saved activations of one micro-batch: {p.activation_bytes:,};\n"
        f"- no weight casts: the matmuls read the gathered bf16 weights;\n"
        f"- temporaries: in the backward, at its largest moment (the first block it goes "
        f"through, recomputing its forward beside the head's whole gradient: FSDP2 makes each "
        f"micro-batch's whole gradients anew, then reduce-scatters them into the shards): "
        f"{t['backward']['temporaries']:,}; after the backward, with the gathered weights "
        f"resharded, the root unit's reduce-scatter (embedding, final norm and head: the first "
        f"micro-batch's root shard, one vocabulary matrix's whole gradient and the fp32 input of "
        f"the reduce-scatter): {t['reduce']['temporaries']:,}; at the optimizer step, the "
        f"for-loop AdamW's temporaries: {t['step']['temporaries']:,}.\n"
        f"The peak is the largest of three moments: the largest moment of the (second) backward, "
        f"the root unit's reduce-scatter after it and the optimizer step.")


def peak_evidence(r: Rows, s: Setup) -> dict[str, str]:
    t, p = moments(s, TOP), plan(s, TOP)
    sums = {k: sum(v.values()) for k, v in t.items()}
    measured = [r.get(VARIANT, "peak_mem_bytes", rank=k, **TOP) for k in range(shape(s, TOP)["N"])]
    peak = max(sums, key=sums.get)
    others = [f"its {MOMENT_WORDS[k]} {mib(v)}" for k, v in sums.items() if k != peak]
    return {"moment": MOMENT_WORDS[peak], "others": " and ".join(others),
            "terms": " + ".join(f"{k} {v:,}" for k, v in t[peak].items()),
            "total": f"{sums[peak]:,}",
            "peaks": ", ".join(mib(v) for v in measured),
            "ratio": show(100 * (measured[0] or 0) / p.total_bytes, "%")}


def peak_supports(r: Rows, s: Setup) -> str | None:
    """Every rank's measured peak within 10% of the planner's; its shards and kept casts within 1%."""
    p = plan(s, TOP)
    want = {"peak_mem_bytes": (p.total_bytes, 0.10), "param_bytes": (p.param_bytes, 0.01),
            "grad_bytes": (p.grad_bytes, 0.01),
            "saved_weight_copy_bytes": (p.kept_weight_copy_bytes, 0.01)}
    for rank in range(shape(s, TOP)["N"]):
        for metric, (predicted, rel) in want.items():
            got = r.get(VARIANT, metric, rank=rank, **TOP)
            if got is None or abs(got - predicted) > rel * predicted:
                return f"rank {rank}'s {metric} is {got!r}, predicted {predicted:,} (±{rel:.0%})"
    return None


def gathered_as_fp32(s: Setup) -> float:
    """The peak with the gathered whole weights counted in fp32 (4Ψ, not 2Ψ), as if autocast
    cast them after an fp32 gather."""
    sums = {k: sum(v.values()) for k, v in moments(s, TOP).items()}
    sums["backward"] += plan(s, TOP).gathered_bytes
    return max(sums.values()) / MiB


def recipe_peak() -> Exercise:
    return Exercise(
        "recipe_peak", TOPICS[0], "recipe",
        answer=lambda s: peak_of(s, TOP) / MiB,
        evidence=peak_evidence,
        level=3, mistake=gathered_as_fp32,
        supports=peak_supports, unit="MiB", rel_tol=0.02, details=peak_details)


# --- The ladder ------------------------------------------------------------------------------------

def first_fit(s: Setup, forget_accumulated: bool = False) -> str:
    """The first rung whose planned peak fits the budget; `forget_accumulated`: as a learner who
    forgets that DDP's accumulated .grad sits beside its buckets would find it."""
    for name, point in RUNGS.items():
        peak = peak_of(s, point)
        if forget_accumulated and point["zero_stage"] == 0 and point["micro_batches"] > 1:
            peak -= plan(s, point).grad_bytes
        if peak <= budget_bytes(s):
            return name
    return NONE


def rung_line(s: Setup, name: str) -> str:
    t = moments(s, RUNGS[name])
    b = t["backward"]
    if "forward" not in t:  # ZeRO-2: FSDP2's bf16 policy, no casts
        return (f"- {name}: saved activations {b['activations']:,}; no casts; temporaries at the "
                f"backward's largest moment {b['temporaries']:,}, at the root unit's "
                f"reduce-scatter after it {t['reduce']['temporaries']:,} (beside the gradient "
                f"shards)")
    f = t["forward"]
    return (f"- {name}: saved activations {b['activations']:,}; casts cached to the forward's end "
            f"{f['casts']:,}, kept by the backward {b['casts']:,}; temporaries at the forward's end "
            f"{f['temporaries']:,}, at the start of backward {b['temporaries']:,}")


def ladder_details(s: Setup) -> str:
    n, base, top = shape(s, RUNGS["bf16 on DDP"]), plan(s, RUNGS["bf16 on DDP"]), plan(s, TOP)
    step = max(moments(s, point)["step"]["temporaries"] for point in RUNGS.values())
    return (
        f"Model: {n['L']} layers, hidden {n['d']}, vocabulary {n['V']}, Ψ = {n['psi']:,} parameters; "
        f"{s.cfg().batch_size} sequences of {n['s']} tokens per rank and step; N = {n['N']} ranks; "
        f"budget {budget_bytes(s) / MiB:g} MiB = {budget_bytes(s):,} bytes per rank. {DIST_WORDS}\n"
        f"Model states, per rank, in bytes: DDP holds the fp32 weights 4Ψ = {base.param_bytes:,}, "
        f"AdamW's moments 8Ψ = {base.optimizer_bytes:,} and its gradient buckets 4Ψ = "
        f"{base.grad_bytes:,} for the model's life; the .grad tensors are separate from the buckets "
        f"(gradient_as_bucket_view=False, the default) and accumulate between micro-batches. ZeRO-2 "
        f"(FSDP2) holds a weight shard 4Ψ/N = {top.param_bytes:,}, moments 8Ψ/N = "
        f"{top.optimizer_bytes:,} and gradient shards 4Ψ/N = {top.grad_bytes:,}; there bf16 is "
        f"FSDP2's mixed-precision policy in place of autocast: the whole weights, gathered in "
        f"bf16, 2Ψ = {top.gathered_bytes:,}, from a unit's forward to its backward, and no "
        f"casts.\n"
        f"Per rung, in bytes (activations and temporaries are one micro-batch's; with ZeRO-2 the "
        f"backward's temporaries include one unit's whole gradient before its reduce-scatter):\n"
        + "\n".join(rung_line(s, name) for name in RUNGS)
        + f"\nThe optimizer step holds the model states and at most {step:,} bytes of AdamW's "
          f"temporaries (never the peak here).")


def ladder_evidence(r: Rows, s: Setup) -> dict[str, str]:
    lines = []
    for name, point in RUNGS.items():
        row = r.get(VARIANT, **point) or {}
        fits = row.get("status") == "ok"
        measured = f"fits, measured {mib(r.get(VARIANT, 'peak_mem_bytes', **point))}" if fits \
            else f"{row.get('status', 'absent')} ({row.get('message', '')})"
        lines.append(f"{name}: planned {mib(peak_of(s, point))}, {measured}")
    return {"rungs": "; ".join(lines), "budget": mib(budget_bytes(s))}


def ladder_supports(r: Rows, s: Setup) -> str | None:
    """Every rung before the answer is an oom row on every rank; the answer's fits on every rank,
    its measured peak under the budget."""
    answer = first_fit(s)
    for name, point in RUNGS.items():
        for rank in range(shape(s, point)["N"]):
            status = (r.get(VARIANT, rank=rank, **point) or {}).get("status")
            peak = r.get(VARIANT, "peak_mem_bytes", rank=rank, **point)
            if name != answer and status != "oom":
                return f"rung {name!r} on rank {rank} is {status!r}, not oom under the budget"
            if name == answer and (status != "ok" or peak is None or peak > budget_bytes(s)):
                return f"rung {name!r} on rank {rank}: {status!r}, peak {peak!r} over the budget"
        if name == answer:
            return None
    return None if answer == NONE else f"no rung {answer!r} measured"


def ladder_fit() -> Exercise:
    return Exercise(
        "ladder_fit", TOPICS[3], "recipe",
        answer=first_fit, evidence=ladder_evidence,
        level=3, mistake=lambda s: first_fit(s, forget_accumulated=True),
        supports=ladder_supports, choices=(*RUNGS, NONE), details=ladder_details)


# --- The chunked loss's activations --------------------------------------------------------------

PLAIN_LOSS, CHUNKED = {"loss": "plain"}, {"loss": "chunked", "loss_chunk": 16}


def tokens_vocab(s: Setup) -> tuple[int, int]:
    c = s.cfg(VARIANT, **CHUNKED)
    return c.batch_size * c.seq_len, c.model.vocab_size


def chunked_saving(s: Setup) -> int:
    """What the chunked loss takes off the activations a step keeps for its backward (the
    planner's terms): the plain loss's fp32 log-probabilities and its total-weight scalar, less
    the chunked one's log-sum-exp per token."""
    plain = recipe.planned(s.cfg(VARIANT, **PLAIN_LOSS)).activation_bytes
    return plain - recipe.planned(s.cfg(VARIANT, **CHUNKED)).activation_bytes


def chunked_details(s: Setup) -> str:
    tokens, vocab = tokens_vocab(s)
    return (f"One process, fp32, the tiny model with one layer and a vocabulary of V = {vocab}; "
            f"b x s = {tokens} tokens; the chunked loss makes 16 tokens of logits at a time.")


def chunked_evidence(r: Rows, s: Setup) -> dict[str, str]:
    plain, chunked = (r.get(VARIANT, "activation_bytes", **p) for p in (PLAIN_LOSS, CHUNKED))
    return {"plain": show(plain, "bytes"), "chunked": show(chunked, "bytes"),
            "measured": show(None if None in (plain, chunked) else plain - chunked, "bytes")}


def chunked_supports(r: Rows, s: Setup) -> str | None:
    plain, chunked = (r.get(VARIANT, "activation_bytes", **p) for p in (PLAIN_LOSS, CHUNKED))
    if None in (plain, chunked) or plain - chunked != chunked_saving(s):
        return f"the measured saving is {plain!r} - {chunked!r}, the planner's {chunked_saving(s):,}"
    return None


def chunked_loss() -> Exercise:
    return Exercise(
        "chunked_loss_saving", TOPICS[0], "chunked",
        answer=chunked_saving, evidence=chunked_evidence, details=chunked_details,
        level=2, mistake=lambda s: 8 * math.prod(tokens_vocab(s)),
        supports=chunked_supports, unit="bytes", rel_tol=0.001)


EIGHT_BIT, PACKED = {"optimizer": "adamw8bit"}, {"packing": True}


def tensor_words(s: Setup) -> str:
    """The model's parameter tensors by size (elements x how many)."""
    m = s.cfg(VARIANT, **EIGHT_BIT).model
    sizes = planner.stage_tensors(m)
    counts = {n: sizes.count(n) for n in sorted(set(sizes), reverse=True)}
    return (f"One process, fp32, the tiny model with one layer: its {len(sizes)} parameter tensors hold "
            + ", ".join(f"{n:,} elements ({k} of them)" if k > 1 else f"{n:,} elements" for n, k in counts.items())
            + f", Ψ = {sum(sizes):,} in all.")


def eight_bit_states(s: Setup) -> int:
    return eight_bit_plan(s).optimizer_bytes


def counters(s: Setup) -> int:
    """The optimizer's 0-dim step counters, 4 bytes a tensor, which the measured states include."""
    return 4 * len(planner.stage_tensors(s.cfg(VARIANT, **EIGHT_BIT).model))


def eight_bit_plan(s: Setup) -> planner.MemoryPlan:
    return recipe.planned(s.cfg(VARIANT, **EIGHT_BIT))


def eight_bit_peak(s: Setup) -> int:
    return eight_bit_plan(s).total_bytes


def eight_bit_peak_words(s: Setup) -> str:
    p = eight_bit_plan(s)
    return (tensor_words(s) + f" At the optimizer step the weights and the gradients take {p.param_bytes:,} bytes "
            f"each and AdamW8bit's states {p.optimizer_bytes:,}.")


def mask_growth(s: Setup) -> int:
    """The packed step's activations less the plain step's (the planner's terms)."""
    return (recipe.planned(s.cfg(VARIANT, **PACKED)).activation_bytes
            - recipe.planned(s.cfg(VARIANT, **PLAIN_LOSS)).activation_bytes)


def mask_words(s: Setup) -> str:
    c = s.cfg(VARIANT, **PACKED)
    return (f"One process, fp32, the tiny model with {c.model.num_layers} layer (head_dim {c.model.head_dim}, "
            f"RoPE); {c.batch_size} rows of {c.seq_len} tokens either way.")


def optimizer_exercises() -> list[Exercise]:
    return [
        Exercise(
            "adamw8bit_state_bytes", TOPICS[0], "chunked", answer=eight_bit_states, details=tensor_words,
            evidence=lambda r, s: {"measured": show(r.get(VARIANT, "optimizer_bytes", **EIGHT_BIT), "bytes"),
                                   "fp32": show(r.get(VARIANT, "optimizer_bytes", **PLAIN_LOSS), "bytes"),
                                   "counters": counters(s)},
            level=2, mistake=lambda s: 2 * planner.num_params(s.cfg(VARIANT, **EIGHT_BIT).model),
            supports=lambda r, s: measured_is(VARIANT, "optimizer_bytes", eight_bit_states(s) + counters(s),
                                              r, **EIGHT_BIT),
            unit="bytes", rel_tol=0.001),
        Exercise(
            "adamw8bit_step_peak", TOPICS[0], "chunked", answer=eight_bit_peak, details=eight_bit_peak_words,
            evidence=lambda r, s: {"measured": show(r.get(VARIANT, "peak_mem_bytes", **EIGHT_BIT), "bytes"),
                                   "fp32": show(r.get(VARIANT, "peak_mem_bytes", **PLAIN_LOSS), "bytes")},
            level=3, mistake=lambda s: (lambda p: p.param_bytes + p.grad_bytes + p.optimizer_bytes)(
                eight_bit_plan(s)),
            supports=lambda r, s: measured_is(VARIANT, "peak_mem_bytes", eight_bit_peak(s), r,
                                              0.01 * eight_bit_peak(s), **EIGHT_BIT),
            unit="bytes", rel_tol=0.01),
        Exercise(
            "packed_mask_bytes", TOPICS[0], "chunked", answer=mask_growth, details=mask_words,
            evidence=lambda r, s: {"packed": show(r.get(VARIANT, "activation_bytes", **PACKED), "bytes"),
                                   "plain": show(r.get(VARIANT, "activation_bytes", **PLAIN_LOSS), "bytes")},
            level=3, mistake=lambda s: (lambda c: c.batch_size * c.seq_len ** 2)(s.cfg(VARIANT, **PACKED)),
            supports=lambda r, s: measured_is(
                VARIANT, "activation_bytes", (r.get(VARIANT, "activation_bytes", **PLAIN_LOSS) or 0) + mask_growth(s),
                r, **PACKED),
            unit="bytes", rel_tol=0.001),
    ]


def build_exercises() -> list[Exercise]:
    return [recipe_peak(), ladder_fit(), chunked_loss(), *optimizer_exercises()]
