"""The parallelism, distributed and profiling exercises, against answers computed here.

For each exercise and for "cpu" and "cuda" (the cuda answers are formulas for a simulated H200; no
GPU needed): the careful learner's answer, from the numbers the scenario and details state (closed
forms below, never the exercise's own answer), is graded right; the common mistake, also computed
here, equals the exercise's `mistake` and is graded wrong; and the shared CPU measurement supports
the answer, while a doctored one does not."""
import math

import pytest

from conftest import WALL_CLOCK

from labkit import hardware, planner
from labkit.study import exercises
from labkit.study.exercises import parallel, profiling

MiB = 2**20
KEYS = [ex.key for module in (parallel, profiling) for ex in module.build_exercises()]
DEVICES = ("cpu", "cuda")
N = 2  # the zero Run's data-parallel ranks (the details say so)
P, M = 2, 4  # the pipeline scenario's stages and micro-batches
RING_N = 8  # the ring scenario's ranks
MNK = 256  # the matmul scenario's m = n = k
LAUNCH_US = 10.0  # the roofline details' overhead floor
LINE = {"cpu": 64, "cuda": 32}  # the strided scenario's line and sector bytes
PAD = "pad each dimension to a multiple of 8"


def setup_for(key, device):
    return exercises.Setup(exercises.RUNS[exercises.get(key).run], device)


def psi(s):
    """The parameter count the details print."""
    return planner.num_params(s.cfg().model)


def roofline(s, device):
    ceil = hardware.ceilings(device)
    compute_s = 2 * MNK**3 / (ceil.peak_tflops["float32"] * 1e12)
    memory_s = 3 * MNK**2 * 4 / (ceil.bandwidth_gbps * 1e9)
    if max(compute_s, memory_s) * 1e6 < LAUNCH_US:
        return "launch/overhead-bound"
    return "compute-bound" if compute_s > memory_s else "memory-bound"


def strided(device, count_writes=True):
    read, write = min(4 * 4, LINE[device]), 4 if count_writes else 0
    return (read + write) / (4 + write)


LEARNER = {
    "pipeline_bubble": lambda s, d: (P - 1) / (M + P - 1),
    "ring_allreduce": lambda s, d: 2 * (RING_N - 1) / RING_N * 4 * psi(s) / MiB,
    "zero3_params": lambda s, d: 4 * psi(s) / N / MiB,
    "zero3_grads": lambda s, d: 4 * psi(s) / N / MiB,
    "zero1_optimizer": lambda s, d: 8 * psi(s) / N / MiB,
    "ddp_optimizer": lambda s, d: 8 * psi(s) / MiB,
    "zero_state_saving": lambda s, d: ((4 + 4 + 8 / N) - 16 / N) * psi(s) / MiB,
    "data_wait": lambda s, d: 2 * 50.0,
    "tensor_core_shape": lambda s, d: PAD if 4095 % (16 // 2) else profiling.NOTHING,
    "matmul_intensity": lambda s, d: 2 * MNK**3 / (3 * MNK**2 * 4),
    "roofline_bound": roofline,
    "strided_traffic": lambda s, d: strided(d),
}
MISTAKE = {
    "pipeline_bubble": lambda s, d: (P - 1) / M,
    "ring_allreduce": lambda s, d: 4 * psi(s) / MiB,
    "zero3_params": lambda s, d: 4 * psi(s) / MiB,
    "zero3_grads": lambda s, d: 4 * psi(s) / MiB,
    "zero1_optimizer": lambda s, d: 4 * psi(s) / N / MiB,
    "ddp_optimizer": lambda s, d: 8 * psi(s) / N / MiB,
    "zero_state_saving": lambda s, d: 4 * psi(s) * (N - 1) / N / MiB,
    "data_wait": lambda s, d: 50.0,
    "matmul_intensity": lambda s, d: MNK**3 / (3 * MNK**2 * 4),
    "strided_traffic": lambda s, d: strided(d, count_writes=False),
}


def test_every_exercise_has_a_learner_and_each_numeric_one_its_mistake():
    assert set(LEARNER) == set(KEYS)
    assert {k for k in KEYS if not exercises.get(k).choices} == set(MISTAKE)


def test_scenarios_state_the_numbers_the_learner_uses():
    assert "p = 2" in exercises.describe("pipeline_bubble") and "m = 4" in exercises.describe("pipeline_bubble")
    assert f"N = {RING_N}" in exercises.get("ring_allreduce").scenario
    assert "50 ms" in exercises.get("data_wait").scenario and "2 sequences" in exercises.get("data_wait").scenario
    assert "4095" in exercises.get("tensor_core_shape").scenario
    assert "16 bytes" in exercises.get("tensor_core_shape").scenario
    for device in DEVICES:
        text = exercises.describe("roofline_bound", device)
        ceil = setup_ceilings(device)
        assert f"{ceil.peak_tflops['float32']:.4g} TFLOP/s" in text and f"{ceil.bandwidth_gbps:.4g} GB/s" in text
        assert f"{LAUNCH_US:g} µs" in text
    for key in ("zero3_params", "zero_state_saving", "ring_allreduce"):
        assert f"{psi(setup_for(key, 'cpu')):,} parameters" in exercises.describe(key)


def setup_ceilings(device):
    with exercises.Setup(exercises.RUNS["matmul"], device).formulas():
        return hardware.ceilings(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("key", KEYS)
def test_the_careful_learner_is_graded_right(key, device):
    ex, s = exercises.get(key), setup_for(key, device)
    with s.formulas():
        learner = LEARNER[key](s, device)
    reference = exercises.reference_answer(key, device)
    assert exercises.grade(ex, learner, reference), (key, device, learner, reference)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("key", list(MISTAKE))
def test_the_common_mistake_is_the_exercises_and_graded_wrong(key, device):
    ex, s = exercises.get(key), setup_for(key, device)
    with s.formulas():
        wrong, theirs = MISTAKE[key](s, device), ex.mistake(s)
    assert wrong == pytest.approx(theirs, rel=1e-9)
    assert not exercises.grade(ex, wrong, exercises.reference_answer(key, device))
    assert ex.mistake_why


@pytest.mark.parametrize("key", [k for k in KEYS if exercises.get(k).choices])
def test_choices_have_feedback_and_the_reference_on_both_devices(key):
    ex = exercises.get(key)
    assert set(ex.feedback) == set(ex.choices) and all(ex.feedback.values())
    for device in DEVICES:
        assert exercises.reference_answer(key, device) in ex.choices


@pytest.mark.parametrize("peak_tflops, gbps, bound", [
    (0.37, 20.0, "compute-bound"),  # a CPU core: 90 µs of FLOPs, 39 µs of bytes
    (1.0, 0.05, "memory-bound"),  # 34 µs of FLOPs, 15.7 ms of bytes
    (67.0, 4800.0, "launch/overhead-bound"),  # an H200: 0.5 µs, under the 10 µs of a launch
])
def test_the_roofline_verdict_on_given_ceilings(monkeypatch, peak_tflops, gbps, bound):
    """A 256^3 fp32 matmul (2 x 256^3 FLOPs, 3 x 256^2 x 4 bytes) against ceilings given here,
    not this machine's measured ones: the longer of the two times decides, unless both are
    under a launch."""
    given = hardware.Ceilings(device="cpu", name="given", peak_tflops={"float32": peak_tflops},
                              bandwidth_gbps=gbps, memory_bytes=None, source="test", measured=False)
    monkeypatch.setattr(hardware, "ceilings", lambda device, num_threads=1: given)
    assert exercises.reference_answer("roofline_bound", "cpu") == bound
    compute_s, memory_s = 2 * MNK**3 / (peak_tflops * 1e12), 3 * MNK**2 * 4 / (gbps * 1e9)
    assert (max(compute_s, memory_s) < LAUNCH_US * 1e-6) == (bound == "launch/overhead-bound")


def test_the_roofline_answer_on_an_h200_is_launch_bound():
    """The simulated H200's datasheet (no measurement): 0.5 µs at its fp32 peak, under a launch."""
    assert exercises.reference_answer("roofline_bound", "cuda") == "launch/overhead-bound"


def test_tensor_core_friendly_means_efficient_alignment():
    assert exercises.tensor_core_friendly(4096, 4096, 4096) and not exercises.tensor_core_friendly(4095, 4095, 4095)
    assert exercises.tensor_core_friendly(248, 248, 248)  # 16-byte aligned in fp16 ...
    assert not exercises.tensor_core_friendly(248, 248, 248, align_bytes=128)  # ... not 128-byte
    assert exercises.tensor_core_friendly(256, 256, 256, align_bytes=128)
    assert exercises.tensor_core_friendly(4, 4, 4, dtype_bytes=4)  # tf32: 4 elements are 16 bytes


@pytest.mark.parametrize("key", KEYS)
def test_a_doctored_measurement_does_not_support_it(key, shared_runs):
    """The same rows with every value replaced by -1: the mechanism checks must say so."""
    ex = exercises.get(key)
    rows = exercises.measure(exercises.RUNS[ex.run], "cpu", shared_runs)
    bad = exercises.Rows([{**r, "value": -1.0} for r in rows.rows], "doctored")
    assert ex.supports(bad, exercises.Setup(exercises.RUNS[ex.run], "cpu"))


def test_reports_are_complete_on_the_cpu(shared_runs):
    for key in KEYS:
        report = exercises.check(key, solution=True, device="cpu", runs_dir=shared_runs).report()
        assert "{" not in report and "n/a" not in report, report
        # a wall-clock figure's evidence may carry a note on a throttled CPU (test_exercises)
        assert key in WALL_CLOCK or "Note:" not in report, report
        assert not math.isnan(exercises.get(key).tolerance(1.0))
