"""What every exercise rests on: references for a GPU computed without one (a simulated device's
datasheet ceilings and GPU implementations), hints before answers, and attempts stored like runs."""
import pytest
import torch

from labkit import hardware
from labkit.config import ConfigError
from labkit.study.exercises import EXERCISES, RUNS, Setup, attempts, check, describe, get, hint, measure


@pytest.mark.skipif(torch.cuda.is_available(), reason="a real GPU answers for itself")
def test_a_simulated_gpu_answers_with_its_datasheet_only_inside_the_block():
    with pytest.raises(RuntimeError, match="no CUDA device"):
        hardware.ceilings("cuda")
    with hardware.simulated_gpu("NVIDIA H200"):
        ceil = hardware.ceilings("cuda")
    spec = hardware.gpu_spec("NVIDIA H200")
    assert ceil.bandwidth_gbps == spec["bandwidth_gbps"] and not ceil.measured
    assert ceil.peak_tflops["bfloat16"] == spec["peak_tflops"]["bfloat16"]
    assert ceil.memory_bytes == int(spec["memory_gib"] * 2**30)
    with pytest.raises(ValueError, match="not in data/gpus.json"):
        with hardware.simulated_gpu("Imaginary GPU 9000"):
            pass


@pytest.mark.skipif(torch.cuda.is_available(), reason="a real GPU answers for itself")
def test_a_setup_for_cuda_uses_the_gpus_optimizer_and_is_never_measured():
    from labkit import planner

    cpu, gpu = Setup(RUNS["mp"], "cpu"), Setup(RUNS["mp"], "cuda")
    assert gpu.simulated and gpu.device == "cuda" and not cpu.simulated
    psi = planner.num_params(cpu.cfg().model)
    with gpu.formulas():
        extra = gpu.expected("fp32")["peak_mem_bytes"] - cpu.expected("fp32")["peak_mem_bytes"]
    # torch's CPU AdamW loops over parameters (two temporaries of the largest tensor); CUDA's
    # foreach AdamW copies every moment v (4 bytes x psi): more, by less than the whole copy.
    assert 0 < extra < 4 * psi
    with pytest.raises(ConfigError, match="not present here"):
        measure(RUNS["mp"], "cuda")
    pinned = Setup(RUNS["zero"], "cuda")  # a run that pins its device keeps it
    assert not pinned.simulated and pinned.device == "cpu"


def test_describe_names_the_level_and_the_hint_does_not_give_the_answer():
    key = next(iter(EXERCISES))
    ex = get(key)
    assert describe(key, "cpu").startswith(f"Level {ex.level} ")
    assert hint(key).startswith("Hint: ") and len(hint(key)) > len("Hint: ")


@pytest.mark.slow
def test_an_attempt_is_stored_with_its_person_team_and_verdict(tmp_path, monkeypatch):
    monkeypatch.setenv("LABKIT_PARTICIPANT", "ana")
    runs = str(tmp_path / "runs")
    key = "bf16_param_bytes"  # one single-process run (the mixed-precision step)
    wrong = check(key, 1.0, device="cpu", runs_dir=runs, team="blue")
    right = check(key, solution=True, device="cpu", runs_dir=runs)  # an answer key: not an attempt
    table = attempts.load_attempts(runs)
    assert len(table) == 1 and not right.mistake
    row = table.iloc[0]
    assert (row["exercise"], row["participant"], row["team"], bool(row["correct"])) == (key, "ana", "blue", False)
    assert row["reference"] == pytest.approx(wrong.reference) and row["run_id"] == wrong.run_id
    assert row["kind"] == "exercise" and row["level"] == get(key).level and row["measured"]
    # The attempts folder sits inside the runs folder but never reads as a run.
    from labkit.results import load_runs

    assert all(r["experiment"] == "mixed_precision" for r in load_runs(runs))


def test_a_bad_name_is_refused_in_one_line_and_an_empty_store_is_an_empty_table(tmp_path):
    with pytest.raises(ConfigError, match="not a valid name"):
        attempts.who("ana/../../etc")
    assert attempts.load_attempts(tmp_path).empty
    assert list(attempts.load_attempts(tmp_path).columns) == list(attempts.COLUMNS)


def test_exercise_numbers_use_the_one_number_formatter():
    from labkit.study.exercises.core import show
    from labkit.results import format_number
    for x in (0.0, 12345.0, 1234567.0, 0.0001234, 60.03, float("inf")):
        assert show(x, "bytes") == f"{format_number(x)} bytes"
    assert show(12345.0) == "12,345" and show(None) == "none" and show("x") == "'x'"
