"""Exercises on fine-tuning with LoRA and QLoRA (`labkit.techniques.finetune`): the adapters'
trainable parameters, the AdamW bytes they save against full fine-tuning, the QLoRA base's NF4
bytes, an int8 base's bytes (LoRA on weight-only int8), and why LoRA still runs out of memory at
long context. They name RUNS["finetune"].

Every answer is the planner's (`trainable_params`, `finetune_memory`, `nf4_bytes`), computed
before the measurement; the measured rows are the evidence (`supports` checks that the run's
counts equal the formulas exactly, and that its activations dwarf the adapters' states).

Their words are in notebooks/exercises/text/KEY.md, one file per exercise (`text` reads them)."""
from __future__ import annotations

from labkit import planner
from labkit.config import DTYPE_BYTES
from labkit.study.exercises.core import TOPICS, Exercise, Rows, Setup, mib, model_words, show

ADAMW_BYTES = 8  # two fp32 moments (exp_avg, exp_avg_sq) per trainable parameter
STEP_BYTES = 4  # torch AdamW's step counter: one fp32 scalar per trained tensor
NF4_BLOCK = 64  # weights per NF4 block (one int8 scaler each after double quantization)
# The choice exercise's long context: the model's whole window, batch 1
LONG_BATCH = 1
SHORT_DTYPE = {"float32": "fp32", "bfloat16": "bf16"}
ACTS = "the activations held for the backward, through the frozen layers too"
WEIGHTS = "the frozen base weights"
FROZEN_STATES = "gradients and AdamW moments of the frozen weights"
ADAPTER_STATES = "the adapters' gradients and AdamW moments"


def compute(s: Setup) -> str:
    """The run's compute dtype: the Run pins fp32, so every device answers the same (bf16 would
    halve the moments of full fine-tuning and the NF4 factors)."""
    from labkit.techniques import finetune

    return finetune.compute_dtype(s.cfg("lora"))


def model(s: Setup):
    return s.cfg("lora").model


def adapters(s: Setup) -> tuple[int, tuple[str, ...]]:
    """(rank, targets) of the run's adapters, as its config resolves them."""
    c = s.cfg("lora")
    return c.lora_rank, planner.parse_lora_targets(c.lora_targets)


def target_shapes(s: Setup) -> dict[str, tuple[int, int]]:
    """Each adaptable block linear's (out, in) in labkit's Llama decoder: grouped-query attention
    makes k and v kv_heads x head_dim wide; gate, up and down are SwiGLU's w1, w3 and w2."""
    m = model(s)
    q, kv, d, f = m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim, m.hidden_size, m.ffn_size
    return {"q": (q, d), "k": (kv, d), "v": (kv, d), "o": (d, q), "gate": (f, d), "up": (f, d),
            "down": (d, f)}


def shapes_words(s: Setup) -> str:
    m = model(s)
    shapes = ", ".join(f"{name} {o} x {i}" for name, (o, i) in target_shapes(s).items())
    return (f"{model_words(s)} The block linears, (out x in), in each of the {m.num_layers} "
            f"layers: {shapes}.")


def lora_params(s: Setup) -> int:
    rank, targets = adapters(s)
    return planner.trainable_params(model(s), "lora", lora_rank=rank, lora_targets=targets)


def full_params(s: Setup) -> int:
    return planner.trainable_params(model(s), "full")


def plan(s: Setup, method: str, **sizes: int) -> planner.MemoryPlan:
    """The planner's fine-tuning terms for `method` at the run's sizes (or `sizes`)."""
    c, (rank, targets) = s.cfg(method), adapters(s)
    sizes = {"batch_size": c.batch_size, "seq_len": c.seq_len, **sizes}
    return planner.finetune_memory(c.model, method=method, lora_rank=rank, lora_targets=targets,
                                   compute_dtype=compute(s), device=s.device, **sizes)


def unequal(got, want, what: str) -> str | None:
    """None when the measured `got` is exactly the formula's `want`, else the sentence."""
    return None if got == want else f"the run's {what} is {show(got)}, the formula's {want:,}"


# --- 1. Trainable parameters --------------------------------------------------------------------

def square_mistake(s: Setup) -> int:
    """The common mistake: every target d x d (k and v as wide as q), r x (d + d) each."""
    rank, targets = adapters(s)
    m = model(s)
    return m.num_layers * len(targets) * rank * 2 * m.hidden_size


def params_supports(r: Rows, s: Setup) -> str | None:
    return (unequal(r.get("lora", "trainable_params"), lora_params(s), "LoRA trainable_params")
            or unequal(r.get("full", "trainable_params"), full_params(s), "full trainable_params"))


def params_details(s: Setup) -> str:
    rank, targets = adapters(s)
    return (f"{shapes_words(s)} LoRA rank r = {rank} on {', '.join(targets)} in every layer "
            f"(PEFT's defaults for Llama); the base is frozen.")


def params_exercise() -> Exercise:
    return Exercise(
        "lora_trainable_params", TOPICS[0], "finetune",
        answer=lora_params, details=params_details,
        evidence=lambda r, s: {"lora": show(r.get("lora", "trainable_params")),
                               "full": show(r.get("full", "trainable_params")),
                               "share": show(100 * lora_params(s) / full_params(s), "%")},
        level=1, mistake=square_mistake,
        supports=params_supports, unit="parameters")


# --- 2. Optimizer bytes saved -------------------------------------------------------------------

def optimizer_saving(s: Setup) -> int:
    """The moments of the parameters LoRA leaves frozen (the scenario leaves the step counters
    out; the planner's optimizer_bytes count them)."""
    return ADAMW_BYTES * (full_params(s) - lora_params(s))


def trained_tensors(s: Setup, method: str) -> int:
    """How many tensors AdamW updates: A and B per target and layer; for full fine-tuning every
    parameter tensor of the run's Llama (embedding, head, final norm; 7 linears and 2 norms per
    block, no biases)."""
    m, (_, targets) = model(s), adapters(s)
    if method == "lora":
        return 2 * len(targets) * m.num_layers
    assert m.arch == "llama" and not m.qkv_bias, "the count below is a bias-free Llama's"
    return (1 if m.tie_embeddings else 2) + 1 + 9 * m.num_layers


def saving_supports(r: Rows, s: Setup) -> str | None:
    """The measured state is the two fp32 moments exactly, plus AdamW's 4-byte step counter per
    trained tensor (the scenario leaves those out)."""
    for method, params in (("lora", lora_params(s)), ("full", full_params(s))):
        got = r.get(method, "optimizer_bytes")
        want = ADAMW_BYTES * params + STEP_BYTES * trained_tensors(s, method)
        message = unequal(got, want, f"{method} optimizer_bytes")
        if message:
            return message
    return None


def saving_exercise() -> Exercise:
    return Exercise(
        "lora_optimizer_saving", TOPICS[0], "finetune", answer=optimizer_saving, details=params_details,
        evidence=lambda r, s: {"full": mib(r.get("full", "optimizer_bytes")),
                               "lora": show(r.get("lora", "optimizer_bytes"), "bytes"),
                               "psi": f"{full_params(s):,}", "adapters": f"{lora_params(s):,}"},
        level=2, mistake=lambda s: 2 * ADAMW_BYTES * (full_params(s) - lora_params(s)),
        supports=saving_supports, unit="bytes", rel_tol=0.001)


# --- 3. The QLoRA base's bytes ------------------------------------------------------------------

def linear_counts(s: Setup) -> dict[tuple[int, int], int]:
    """How many block linears of each (out, in) shape the whole model has."""
    counts: dict[tuple[int, int], int] = {}
    for shape in target_shapes(s).values():
        counts[shape] = counts.get(shape, 0) + model(s).num_layers
    return counts


def nf4_base_bytes(s: Setup) -> int:
    return sum(n * planner.nf4_bytes(o, i, block_size=NF4_BLOCK, dtype=compute(s))
               for (o, i), n in linear_counts(s).items())


def flat_4bit_bytes(s: Setup) -> int:
    """The common mistake: half a byte per weight, no scalers."""
    return sum(n * o * i // 2 for (o, i), n in linear_counts(s).items())


def nf4_details(s: Setup) -> str:
    w, dtype = DTYPE_BYTES[compute(s)], SHORT_DTYPE[compute(s)]
    rows = [f"{n} x ({o} x {i}): {o * i // NF4_BLOCK:,} NF4 blocks, scaler block "
            f"{planner.nf4_scaler_block(o * i, NF4_BLOCK)}" for (o, i), n in linear_counts(s).items()]
    return (f"{shapes_words(s)} The run quantizes from {dtype} weights (its compute dtype). "
            f"torchao's NF4Tensor stores, per weight: the 4-bit codes, two per byte; one scaler "
            f"per block of {NF4_BLOCK} weights, double-quantized to int8 (1 byte); one {dtype} "
            f"quantization factor ({w} bytes) per scaler block, the largest of 256, 128, 64, ..., 1 "
            f"that divides the weight's number of blocks; the scalers' mean ({w} bytes); and the "
            f"16-entry NF4 code book in {dtype} ({16 * w} bytes). The model's block linears: "
            + "; ".join(rows) + ".")


def nf4_supports(r: Rows, s: Setup) -> str | None:
    return unequal(r.get("qlora", "linear_weight_bytes"), nf4_base_bytes(s), "QLoRA linear_weight_bytes")


def nf4_exercise() -> Exercise:
    return Exercise(
        "qlora_base_bytes", TOPICS[0], "finetune", answer=nf4_base_bytes, details=nf4_details,
        evidence=lambda r, s: {"measured": show(r.get("qlora", "linear_weight_bytes"), "bytes"),
                               "fp32": show(r.get("full", "linear_weight_bytes"), "bytes"),
                               "bits": show(4 * nf4_base_bytes(s) / flat_4bit_bytes(s), "bits")},
        level=2, mistake=flat_4bit_bytes,
        supports=nf4_supports, unit="bytes", rel_tol=0.005)


# --- 4. An int8 base's bytes ----------------------------------------------------------------------

def int8_base_bytes(s: Setup) -> int:
    return planner.linear_weight_bytes(model(s), "lora_int8")


def int8_codes_only(s: Setup) -> int:
    """The common mistake: one byte per weight, no scales."""
    return sum(n * o * i for (o, i), n in linear_counts(s).items())


def int8_supports(r: Rows, s: Setup) -> str | None:
    return unequal(r.get("lora_int8", "linear_weight_bytes"), int8_base_bytes(s),
                   "lora_int8 linear_weight_bytes")


def int8_exercise() -> Exercise:
    return Exercise(
        "int8_base_bytes", TOPICS[0], "finetune", answer=int8_base_bytes,
        details=lambda s: f"{shapes_words(s)} The scales are bf16 (fp16 for an fp16 model).",
        evidence=lambda r, s: {"measured": show(r.get("lora_int8", "linear_weight_bytes"), "bytes"),
                               "qlora": show(r.get("qlora", "linear_weight_bytes"), "bytes"),
                               "fp32": show(r.get("full", "linear_weight_bytes"), "bytes"),
                               "rows": f"{sum(n * o for (o, _), n in linear_counts(s).items()):,}"},
        level=2, mistake=int8_codes_only,
        supports=int8_supports, unit="bytes", rel_tol=0.001)


# --- 5. Why LoRA still runs out of memory at long context ----------------------------------------

def long_plan(s: Setup) -> planner.MemoryPlan:
    return plan(s, "lora", batch_size=LONG_BATCH, seq_len=model(s).max_seq_len)


def long_terms(s: Setup) -> dict[str, int]:
    """The LoRA step's terms at the long context, by choice; frozen weights hold no states."""
    p = long_plan(s)
    # param_bytes counts the adapters too: their weights are as large as their gradients
    return {ACTS: p.activation_bytes, WEIGHTS: p.param_bytes - p.grad_bytes, FROZEN_STATES: 0,
            ADAPTER_STATES: p.grad_bytes + p.optimizer_bytes}


def largest_term(s: Setup) -> str:
    terms = long_terms(s)
    return max(terms, key=terms.get)


def long_supports(r: Rows, s: Setup) -> str | None:
    """At the run's short context already, LoRA's activations outweigh its adapters' states and
    stay most of full fine-tuning's (they are held through the frozen layers)."""
    acts, full_acts = r.get("lora", "activation_bytes"), r.get("full", "activation_bytes")
    states = (r.get("lora", "grad_bytes") or 0) + (r.get("lora", "optimizer_bytes") or 0)
    if not acts or not full_acts or acts <= states or acts < full_acts / 2:
        return (f"LoRA's activations ({show(acts, 'bytes')}) should exceed its adapters' states "
                f"({show(states, 'bytes')}) and half of full's ({show(full_acts, 'bytes')})")
    return None


def long_evidence(r: Rows, s: Setup) -> dict[str, str]:
    t = long_terms(s)
    return {"acts": mib(t[ACTS]), "weights": mib(t[WEIGHTS]), "states": mib(t[ADAPTER_STATES]),
            "seq": f"{model(s).max_seq_len:,}", "run_seq": f"{s.cfg('lora').seq_len}",
            "run_acts": mib(r.get("lora", "activation_bytes")),
            "full_acts": mib(r.get("full", "activation_bytes"))}


def long_exercise() -> Exercise:
    return Exercise(
        "lora_long_context", TOPICS[0], "finetune",
        answer=largest_term, details=lambda s: (f"{params_details(s)} Context: "
                                                f"{model(s).max_seq_len:,} tokens."),
        evidence=long_evidence, choices=(ACTS, WEIGHTS, FROZEN_STATES, ADAPTER_STATES),
        level=2, mistake=lambda s: FROZEN_STATES,
        supports=long_supports)


def build_exercises() -> list[Exercise]:
    return [params_exercise(), saving_exercise(), nf4_exercise(), int8_exercise(), long_exercise()]

