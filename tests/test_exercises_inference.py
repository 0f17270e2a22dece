"""The inference exercises, graded the way a learner answers them: the careful learner's answer is
computed here from the numbers `describe()` shows (closed forms, independent of `ex.answer`), the
common mistake too; both graded against the reference on the CPU and on a (simulated) GPU. The
shared CPU measurement must show what each answer claims (`supports`)."""
import math
import re

import pytest

from labkit.study import exercises
from labkit.study.exercises import inference

DEVICES = ("cpu", "cuda")
GiB, KiB = 2**30, 2**10


def numbers(key: str, device: str, pattern: str) -> tuple[float, ...]:
    """The numbers `pattern` captures in what the learner is shown (scenario and details)."""
    text = re.sub(r"(\d),(\d)", r"\1\2", exercises.describe(key, device))  # 8,192 -> 8192
    match = re.search(pattern, text)
    assert match, (key, pattern, text)
    return tuple(float(g) for g in match.groups())


def tiny(key, device):
    """(layers, hidden, heads, kv heads, head_dim, ffn, vocab, bytes per value, prompt, new)."""
    return numbers(key, device, r"(\d+) layer, hidden (\d+), (\d+) query heads and (\d+) kv heads of "
                                r"head_dim (\d+), MLP .*? \d+ x (\d+), vocabulary (\d+) .*?\((\d+) bytes "
                                r"per value\)\. Generation: batch 1, a (\d+)-token prompt, (\d+) new")


def llama(key, device):
    """(parameters, GiB of memory, GB/s, bf16 TFLOP/s) from the details."""
    return numbers(key, device, r"Llama-3-8B: (\d+) parameters.*?: (\d+) GiB of memory .*?, (\d+) GB/s.*?"
                                r"([\d.]+) dense bf16")


def served(key, device):
    """The requests as (prompt, output) and the rows, from the details."""
    text = exercises.describe(key, device)
    listed = re.search(r"t = 0: (.*?)\. Rows per step \(batch_size\): (\d+)", text)
    pairs = [tuple(map(int, p)) for p in re.findall(r"\((\d+), (\d+)\)", listed.group(1))]
    return pairs, int(listed.group(2))


def static_batches(pairs, rows):
    return [pairs[i:i + rows] for i in range(0, len(pairs), rows)]


def static_positions(pairs, rows):
    """(all positions computed, real ones): rows x (longest prompt + longest output - 1) a batch."""
    total = sum(len(b) * (max(p for p, _ in b) + max(o for _, o in b) - 1) for b in static_batches(pairs, rows))
    return total, sum(p + o - 1 for p, o in pairs)


def continuous_by_steps(outputs, rows):
    """Step by step: fill free rows in order, advance every running request by one token."""
    queue, running, steps = list(outputs), [], 0
    while queue or running:
        while queue and len(running) < rows:
            running.append(queue.pop(0) - 1)  # the prefill makes the first token
        running = [left for left in running if left > 0]  # an output of 1 is done at its prefill
        if running:
            steps += 1  # a decode step: every running request one token on; the done leave
            running = [left - 1 for left in running if left > 1]
    return steps


def full_rows(key, device):
    pairs, rows = served(key, device)
    return math.ceil(sum(o - 1 for _, o in pairs) / rows)


def pass_flops(L, h, heads, kv, hd, f, V, new, keys):
    weights = h * heads * hd * 2 + h * kv * hd * 2 + 3 * h * f  # q, o; k, v; SwiGLU
    return 2 * new * L * weights + 2 * h * V + 4 * new * keys * heads * hd * L


def prefill_decode_ratio(key, device):
    L, h, heads, kv, hd, f, V, _, prompt, _ = tiny(key, device)
    prefill = pass_flops(L, h, heads, kv, hd, f, V, prompt, prompt)
    return prefill / prompt / pass_flops(L, h, heads, kv, hd, f, V, 1, prompt + 1)


def int8_pct(key, device):
    L, _, _, kv, hd, _, _, nbytes, _, _ = tiny(key, device)
    return 100 * (2 * L * kv * hd * 1 + 2 * L * 4) / (2 * L * kv * hd * nbytes)


def seqs_fit(key, device, kv_heads=8):
    params, gib, _, _ = llama(key, device)
    return (gib * GiB - 2 * params) // (2 * 32 * kv_heads * 128 * 2 * 8192)


LEARNER = {
    "kv_per_token": lambda d: 2 * 32 * 8 * 128 * 2 / KiB,
    "gqa_kv_saving": lambda d: 2 * 32 * (32 - 8) * 128 * 2 * 8192 / GiB,
    "kv_int8_ratio": lambda d: int8_pct("kv_int8_ratio", d),
    "kv_speedup": lambda d: "the cached run",  # the textbook answer: far fewer FLOPs
    "kv_concurrent_8k": lambda d: seqs_fit("kv_concurrent_8k", d),
    "decode_bandwidth_bound": lambda d: (lambda n, _, bw, __: bw * 1e9 / (2 * n))(
        *llama("decode_bandwidth_bound", d)),
    "padding_waste": lambda d: (lambda t, real: 100 * (t - real) / t)(*static_positions(*served("padding_waste", d))),
    "static_steps": lambda d: sum(max(o for _, o in b) - 1 for b in static_batches(*served("static_steps", d))),
    "prefill_decode_flops": lambda d: prefill_decode_ratio("prefill_decode_flops", d),
    "continuous_steps": lambda d: (lambda pairs, rows: continuous_by_steps([o for _, o in pairs], rows))(
        *served("continuous_steps", d)),
}
MISTAKE = {
    "kv_per_token": lambda d: 2 * 32 * 32 * 128 * 2 / KiB,  # every query head cached
    "gqa_kv_saving": lambda d: 32 * (32 - 8) * 128 * 2 * 8192 / GiB,  # keys only
    "kv_int8_ratio": lambda d: 25.0,  # the scales forgotten
    "kv_concurrent_8k": lambda d: seqs_fit("kv_concurrent_8k", d, kv_heads=32),
    "decode_bandwidth_bound": lambda d: (lambda n, _, __, tf: tf * 1e12 / (2 * n))(
        *llama("decode_bandwidth_bound", d)),
    "padding_waste": lambda d: (lambda t, real: 100 * (t - real) / real)(*static_positions(*served("padding_waste", d))),
    "static_steps": lambda d: full_rows("static_steps", d),
    "prefill_decode_flops": lambda d: 1.0,  # "2 FLOPs per parameter per token" either way
    "continuous_steps": lambda d: full_rows("continuous_steps", d),
}
KEYS = [ex.key for ex in inference.build_exercises()]


def test_every_inference_exercise_is_covered_and_registered():
    assert set(KEYS) == set(LEARNER) and set(KEYS) - {"kv_speedup"} == set(MISTAKE)
    assert all(k in exercises.EXERCISES for k in KEYS)
    for key in KEYS:
        ex = exercises.get(key)
        assert ex.level in (1, 2, 3) and ex.hint and ex.supports
        assert ex.feedback if ex.choices else (ex.mistake and ex.mistake_why)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("key", KEYS)
def test_the_careful_learner_is_graded_right(key, device):
    ex = exercises.get(key)
    reference = exercises.reference_answer(key, device)
    learner = LEARNER[key](device)
    assert exercises.grade(ex, learner, reference), (key, device, learner, reference)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("key", sorted(MISTAKE))
def test_the_common_mistake_is_graded_wrong(key, device):
    ex = exercises.get(key)
    setup = exercises.Setup(exercises.RUNS[ex.run], device)
    with setup.formulas():
        assert ex.mistake(setup) == pytest.approx(MISTAKE[key](device))
        assert ex.is_mistake(MISTAKE[key](device), setup)
    assert not exercises.grade(ex, MISTAKE[key](device), exercises.reference_answer(key, device))


@pytest.mark.parametrize("device", DEVICES)
def test_kv_speedup_choices_and_threshold(device):
    ex = exercises.get("kv_speedup")
    assert set(ex.feedback) == set(ex.choices)
    assert exercises.reference_answer("kv_speedup", device) == "the cached run"
    assert f"at most {inference.SAME_SPEED:g}x" in exercises.describe("kv_speedup", device)
    # the stated threshold is the one the grading uses
    assert exercises.faster(inference.SAME_SPEED * 0.99) == "about the same"
    assert exercises.faster(inference.SAME_SPEED * 1.01) == "the cached run"


def test_the_serving_workload_refills_rows():
    """Not degenerate: more requests than rows, outputs of different lengths, and the three
    schedules (static, continuous, every row always busy) all differ."""
    pairs, rows = served("continuous_steps", "cpu")
    assert len(pairs) > rows and len({o for _, o in pairs}) > 2
    steps = {f: exercises.reference_answer(f, "cpu") for f in ("static_steps", "continuous_steps")}
    assert steps["static_steps"] > steps["continuous_steps"] > full_rows("continuous_steps", "cpu")


def test_continuous_decode_steps_closed_form():
    assert inference.continuous_decode_steps([5, 5, 5, 5], 2) == 8
    assert inference.continuous_decode_steps([11, 5, 4, 32, 12, 32, 32, 32], 4) == 45
    assert continuous_by_steps([11, 5, 4, 32, 12, 32, 32, 32], 4) == 45
    assert inference.continuous_decode_steps([3, 9, 2], 1) == 11  # one row: every step in turn


def test_supports_can_fail(shared_runs):
    """A measurement that lacks the mechanism is reported: rows with the wrong figures."""
    rows = exercises.measure(exercises.RUNS["serve"], "cpu", shared_runs)
    setup = exercises.Setup(exercises.RUNS["serve"], "cpu")
    broken = exercises.Rows([dict(r, value=r["value"] + 1) if r["metric"] == "decode_steps" else r
                             for r in rows.rows], "altered")
    for key in ("static_steps", "continuous_steps"):
        assert "decode_steps" in exercises.get(key).supports(broken, setup)
    kv = exercises.measure(exercises.RUNS["kv"], "cpu", shared_runs)
    doubled = exercises.Rows([dict(r, value=2 * r["value"]) if r["metric"] == "kv_bytes_per_token" else r
                              for r in kv.rows], "altered")
    assert exercises.get("kv_per_token").supports(doubled, exercises.Setup(exercises.RUNS["kv"], "cpu"))
