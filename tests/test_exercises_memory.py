"""The memory and precision exercises, graded from outside: for each, the answer a careful learner
derives from the scenario and details (closed forms written here, from the model's shapes, never
from `ex.answer` or an experiment's `expected()`) must be graded right on a CPU and on a (simulated)
GPU, the common mistake must be graded wrong there, and the shared CPU measurement must show what
the answer claims."""
import math

import pytest

from labkit.study import exercises
from labkit.study.exercises import RUNS, Setup

MiB, KiB = 2**20, 2**10
DEVICES = ("cpu", "cuda")


def shapes(s):
    """The numbers the details state, as plain names."""
    m, c = s.cfg().model, s.cfg()
    assert m.arch == "llama" and not m.tie_embeddings  # the closed forms below assume both
    q, kv = m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim
    return dict(L=m.num_layers, d=m.hidden_size, q=q, kv=kv, f=m.ffn_size, V=m.vocab_size,
                heads=m.num_heads, hd=m.head_dim, b=c.batch_size, s=c.seq_len)


def psi(x):
    """Embedding + untied head + per block (wq, wo, wk, wv, w1, w2, w3 and two RMSNorms) + final norm."""
    block = 2 * x["d"] * x["q"] + 2 * x["d"] * x["kv"] + 3 * x["d"] * x["f"] + 2 * x["d"]
    return 2 * x["V"] * x["d"] + x["L"] * block + x["d"]


def block_bytes(x):
    """Per token, one fp32 block: two RMSNorms, q/k/v and SDPA's output, logsumexp, SwiGLU."""
    d = x["d"]
    return 2 * (4 * d + 4 + 8 * d) + 4 * (2 * x["q"] + 2 * x["kv"]) + 4 * x["heads"] + 16 * x["f"]


def head_bytes(x):
    """Per token: the final norm, fp32 log-probabilities, int64 targets."""
    return (4 * x["d"] + 4 + 8 * x["d"]) + 4 * x["V"] + 8


def fixed_bytes(x):
    return 2 * x["s"] * x["hd"] * 4 + 4  # RoPE's cos and sin (fp32), the loss's total_weight


def step_temporaries(x, device):
    """CPU for-loop AdamW: 4 x (final norm + 2 x head); GPU foreach: 4 bytes per parameter."""
    return 4 * (x["d"] + 2 * x["V"] * x["d"]) if device == "cpu" else 4 * psi(x)


def peak_memory(s):
    x = shapes(s)
    tokens = x["b"] * x["s"]
    acts = tokens * (x["L"] * block_bytes(x) + head_bytes(x)) + fixed_bytes(x)
    backward = 12 * psi(x) + acts + 8 * tokens * x["V"]
    step = 16 * psi(x) + step_temporaries(x, s.device)
    return max(backward, step) / MiB


def saving(s, kept_per_token):
    x = shapes(s)
    return x["L"] * x["b"] * x["s"] * (block_bytes(x) - kept_per_token(x)) / MiB


def selective_kept(x):
    return 4 * (3 * x["d"] + 2 * x["q"] + 2 * x["kv"] + 2 * x["f"]) + 4 * x["heads"]


def plain_step_flops(x):
    tokens, attn = x["b"] * x["s"], 4 * x["b"] * x["s"] ** 2 * x["heads"] * x["hd"] * x["L"]
    linear = 2 * x["d"] * x["q"] + 2 * x["d"] * x["kv"] + 3 * x["d"] * x["f"]
    return 6 * tokens * (x["L"] * linear + x["V"] * x["d"]) + 7 * attn // 2


def recompute_cost(s):
    x = shapes(s)
    without_w2 = 2 * x["d"] * x["q"] + 2 * x["d"] * x["kv"] + 2 * x["d"] * x["f"]
    per_block = 2 * x["b"] * x["s"] * without_w2 + 4 * x["b"] * x["s"] ** 2 * x["heads"] * x["hd"]
    return 100 * x["L"] * per_block / plain_step_flops(x)


def largest_micro_batch(s, *, loss_temporaries=True):
    x, c = shapes(s), s.cfg()
    budget = int(c.memory_budget_gib * 2**30)
    per_seq = x["s"] * (x["L"] * block_bytes(x) + head_bytes(x) + (8 * x["V"] if loss_temporaries else 0))
    if 16 * psi(x) + step_temporaries(x, s.device) > budget:
        return 0
    return min(c.max_batch_size, (budget - 16 * psi(x) - fixed_bytes(x)) // per_seq)


def kv_kib(s, positions_extra=0):
    c = s.cfg("dynamic")
    m = c.model
    per_token = 2 * m.num_layers * m.num_kv_heads * m.head_dim * 4
    return per_token * c.batch_size * (c.prompt_len + c.new_tokens - 1 + positions_extra) / KiB


def train_flops(s):
    x = shapes(s)
    tokens = x["b"] * x["s"]
    matmul_params = x["L"] * (2 * x["d"] * x["q"] + 2 * x["d"] * x["kv"] + 3 * x["d"] * x["f"]) + x["V"] * x["d"]
    return (6 * matmul_params * tokens + 14 * x["b"] * x["s"] ** 2 * x["d"] * x["L"]) / 1e6


def fp8_rowwise(s, scale_per_row=True):
    """Each block linear (all of the tiny model's dimensions are multiples of 16) in 1 byte per
    weight, plus a 4-byte scale per output row (rowwise) or per tensor; the head stays."""
    x = shapes(s)
    linears = [(x["q"], x["d"]), (x["kv"], x["d"]), (x["kv"], x["d"]), (x["d"], x["q"]),
               (x["f"], x["d"]), (x["f"], x["d"]), (x["d"], x["f"])]
    return x["L"] * sum(n * k + 4 * (n if scale_per_row else 1) for n, k in linears)


LEARNER = {
    "peak_memory": peak_memory,
    "checkpoint_saving": lambda s: saving(s, lambda x: 4 * x["d"]),
    "selective_saving": lambda s: saving(s, selective_kept),
    "recompute_cost": recompute_cost,
    "fitting_batch": largest_micro_batch,
    "accumulation_steps": lambda s: math.ceil(s.cfg().effective_batch / largest_micro_batch(s)),
    "kv_cache_bytes": kv_kib,
    "bf16_param_bytes": lambda s: 2 * psi(shapes(s)) / MiB,
    "mixed_state_bytes": lambda s: (2 + 2 + 4 + 4 + 4) * psi(shapes(s)) / MiB,
    "fp16_underflow": lambda s: 0.0 if 1e-8 < 2.0**-25 else 2.0**-24,  # the nearer fp16 neighbour
    "fp16_range": lambda s: "inf in fp16, finite in bf16" if 300**2 + 250**2 > 65504 else "finite in both",
    "train_flops": train_flops,
    "fp8_rowwise_weight_bytes": fp8_rowwise,
}
MISTAKE = {
    "peak_memory": lambda s: 16 * psi(shapes(s)) / MiB,
    "checkpoint_saving": lambda s: saving(s, lambda x: 0),
    "selective_saving": lambda s: saving(s, lambda x: 4 * x["d"]),
    "recompute_cost": lambda s: 100 / 3,
    "fitting_batch": lambda s: largest_micro_batch(s, loss_temporaries=False),
    "accumulation_steps": lambda s: s.cfg().effective_batch // largest_micro_batch(s),
    "kv_cache_bytes": lambda s: kv_kib(s, positions_extra=1),
    "bf16_param_bytes": lambda s: 6 * psi(shapes(s)) / MiB,
    "mixed_state_bytes": lambda s: 8 * psi(shapes(s)) / MiB,
    "fp16_underflow": lambda s: 1e-8,
    "train_flops": lambda s: 6 * psi(shapes(s)) * shapes(s)["b"] * shapes(s)["s"] / 1e6,
    "fp8_rowwise_weight_bytes": lambda s: fp8_rowwise(s, scale_per_row=False),
}
# Other wrong answers the tolerance must reject too.
ALSO_WRONG = {"recompute_cost": lambda s: 100 * x_full_forward(s), "fp16_underflow": lambda s: 2.0**-24}


def x_full_forward(s):
    """Recomputing each block's whole forward, w2 included (no early stop)."""
    x = shapes(s)
    linear = 2 * x["d"] * x["q"] + 2 * x["d"] * x["kv"] + 3 * x["d"] * x["f"]
    per_block = 2 * x["b"] * x["s"] * linear + 4 * x["b"] * x["s"] ** 2 * x["heads"] * x["hd"]
    return x["L"] * per_block / plain_step_flops(x)


def setup_of(key, device):
    return Setup(RUNS[exercises.get(key).run], device)


def test_every_exercise_of_these_modules_is_covered():
    from labkit.study.exercises import memory, precision

    keys = {ex.key for module in (memory, precision) for ex in module.build_exercises()}
    assert keys == set(LEARNER)
    assert {k for k in keys if not exercises.get(k).choices} == set(MISTAKE)
    for key in keys:
        ex = exercises.get(key)
        assert ex.level in exercises.LEVELS and ex.hint and ex.supports is not None
        assert ex.choices or ex.mistake_why


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("key", list(LEARNER))
def test_the_careful_learners_answer_is_graded_right(key, device):
    ex, s = exercises.get(key), setup_of(key, device)
    reference = exercises.reference_answer(key, device)
    learner = LEARNER[key](s)
    assert exercises.grade(ex, learner, reference), (learner, reference)
    if not ex.choices:
        assert learner == pytest.approx(reference, rel=1e-9), "the why's method must reproduce it"
        assert reference > 0 and math.isfinite(reference) or key == "fp16_underflow"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("key", list(MISTAKE))
def test_the_common_mistake_is_graded_wrong(key, device):
    ex, s = exercises.get(key), setup_of(key, device)
    reference = exercises.reference_answer(key, device)
    wrong = MISTAKE[key](s)
    with s.formulas():  # the GPU's datasheet, as the reference had
        assert ex.mistake(s) == pytest.approx(wrong, rel=1e-9) and ex.is_mistake(wrong, s)
    assert not exercises.grade(ex, wrong, reference)
    if key in ALSO_WRONG:
        assert not exercises.grade(ex, ALSO_WRONG[key](s), reference)


@pytest.mark.parametrize("device", DEVICES)
def test_the_batch_exercises_are_meaningful_on_both_devices(device):
    assert exercises.reference_answer("fitting_batch", device) >= 2
    micro = exercises.reference_answer("fitting_batch", device)
    effective = setup_of("fitting_batch", device).cfg().effective_batch
    assert effective % micro, "a remainder: rounding down must be a wrong answer"
    assert exercises.reference_answer("accumulation_steps", device) >= 2


@pytest.mark.parametrize("device", DEVICES)
def test_the_details_state_the_numbers_the_learner_needs(device):
    x = shapes(setup_of("peak_memory", device))
    temps = f"{step_temporaries(x, device):,}"
    assert temps in exercises.describe("peak_memory", device)
    fx = shapes(setup_of("fitting_batch", device))
    text = exercises.describe("fitting_batch", device)
    per_seq = fx["s"] * (fx["L"] * block_bytes(fx) + head_bytes(fx))
    for number in (step_temporaries(fx, device), per_seq, fixed_bytes(fx), 8 * fx["s"] * fx["V"]):
        assert f"{number:,}" in text, number
    assert f"{block_bytes(shapes(setup_of('checkpoint_saving', device))):,}" in \
        exercises.describe("checkpoint_saving", device)
    assert f"{plain_step_flops(shapes(setup_of('recompute_cost', device))):,}" in \
        exercises.describe("recompute_cost", device)
    assert "round" in exercises.describe("fp16_underflow", device).lower()


def test_the_choice_exercise_has_feedback_for_every_choice():
    ex = exercises.get("fp16_range")
    assert set(ex.feedback) == set(ex.choices)
    for device in DEVICES:
        assert exercises.reference_answer("fp16_range", device) == LEARNER["fp16_range"](None)


# A measurement that contradicts the answer: (variant, metric, new value from the old).
SPOILED = {
    "peak_memory": ("fp32", "peak_mem_bytes", lambda v: 1.5 * v),
    "checkpoint_saving": ("full", "activation_bytes", lambda v: 2 * v),
    "selective_saving": ("selective", "flops", lambda v: 1.2 * v),
    "recompute_cost": ("full", "flops", lambda v: 1.3 * v),
    "fitting_batch": ("fp32", "max_batch_size", lambda v: v + 3),
    "accumulation_steps": ("fp32", "accumulation_steps", lambda v: v - 1),
    "kv_cache_bytes": ("dynamic", "kv_bytes_per_token", lambda v: 2 * v),
    "bf16_param_bytes": ("bf16_weights", "param_bytes", lambda v: 2 * v),
    "mixed_state_bytes": ("bf16_weights", "optimizer_bytes", lambda v: v * 2 / 3),
    "fp16_underflow": ("fp16", "loss_scale", lambda v: 1.0),
}


@pytest.mark.parametrize("key", list(SPOILED))
def test_a_measurement_that_contradicts_the_answer_is_flagged(key, shared_runs):
    ex = exercises.get(key)
    rows = exercises.measure(RUNS[ex.run], "cpu", shared_runs)
    variant, metric, spoil = SPOILED[key]
    changed = [dict(r, value=spoil(r["value"])) if (r["variant"], r["metric"]) == (variant, metric)
               else r for r in rows.rows]
    assert changed != rows.rows
    said = ex.supports(exercises.Rows(changed, rows.source), setup_of(key, "cpu"))
    assert isinstance(said, str) and said
