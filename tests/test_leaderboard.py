"""The workshop leaderboard: who wins each challenge, compared only within a fair group (the same
model shape, rank count, dtype, `same` settings and machine class), with every number's
provenance; and the learning view of the room's exercise attempts, on frames built here.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pandas as pd
import pytest

from labkit.study import leaderboard as lb
from labkit.config import MODELS, ConfigError, RunConfig, resolve
from labkit.results import RunRecord, load_results, unit_of

CPU = "AMD EPYC 7763"  # a CPU model two hosts of the room share


def _env(gpu: str | None, host: str = "host-a", num_cores: int = 8) -> dict:
    if gpu:
        return {"device": "cuda", "gpus": [{"name": gpu}], "hostname": host}
    return {"device": "cpu", "cpu": {"model": CPU, "num_cores": num_cores}, "hostname": host}


def _result(run_id, participant, experiment, variant, metric, value, *, gpu=None, preset="small",
            status="ok", rank=0, date="2026-01-01T10:00:00+00:00", host="host-a", num_cores=8,
            dtype="float32", nproc=None, model=None, **settings):
    """One stored row as the harness writes it: `params` is the resolved config (every model
    field under `model`), `model` overrides some of the preset's fields."""
    shape = {**dataclasses.asdict(MODELS[preset]), **(model or {})}
    params = {"participant": participant, "team": participant.upper(), "preset": preset,
              "device": "cuda" if gpu else "cpu", "dtype": dtype, "model": shape,
              "sweep": dict(settings), **settings}
    if nproc is not None:
        params["nproc"] = nproc
    return {"run_id": run_id, "timestamp": date, "experiment": experiment, "variant": variant,
            "params": params, "metric": metric, "value": value, "unit": unit_of(metric),
            "predicted": None, "status": status, "message": "", "rank": rank,
            "env": _env(gpu, host, num_cores)}


def _best(rows: list[dict], experiment: str) -> pd.DataFrame:
    best = lb.best_per_challenge(lb.board(pd.DataFrame(rows)))
    return best[best["experiment"] == experiment].set_index("group")


@pytest.fixture
def room() -> pd.DataFrame:
    rows = [
        _result("k1", "ana", "kv_cache", "static", "tokens_per_s", 900.0, gpu="NVIDIA H100"),
        _result("k2", "ben", "kv_cache", "paged", "tokens_per_s", 1200.0, gpu="NVIDIA H100",
                host="host-b"),  # another host of the same class: competes with k1
        _result("k3", "cy", "kv_cache", "paged", "tokens_per_s", 5000.0, gpu="NVIDIA H100",
                status="oom"),  # not measured: never wins
        _result("k4", "dee", "kv_cache", "paged", "tokens_per_s", 9000.0, preset="medium",
                gpu="NVIDIA H200"),  # another preset: its own group
        _result("k5", "ben", "kv_cache", "paged", "tokens_per_s", 1200.0, gpu="NVIDIA H100",
                host="host-b", date="2026-01-01T11:00:00+00:00"),  # a later tie: k2 keeps the lead
        _result("k6", "eve", "kv_cache", "paged", "tokens_per_s", 3000.0, gpu="NVIDIA L4"),
        _result("c1", "ana", "checkpointing", "full", "peak_mem_bytes", 3e9, batch_size=8, seq_len=512),
        _result("c2", "ben", "checkpointing", "none", "peak_mem_bytes", 2e9, batch_size=4, seq_len=512),
        _result("c3", "cy", "checkpointing", "selective", "peak_mem_bytes", 4e9, batch_size=8,
                seq_len=512),
        _result("z1", "ana", "zero", "zero3", "peak_mem_bytes", 1e9, rank=1, nproc=2),  # rank 1: out
        _result("z1", "ana", "zero", "zero3", "peak_mem_bytes", 2e9, rank=0, nproc=2),
    ]
    return lb.board(pd.DataFrame(rows))


H100 = "small, 1 rank, float32, NVIDIA H100"


def test_best_per_challenge_picks_the_right_run_with_its_provenance(room):
    best = lb.best_per_challenge(room)
    kv = best[best["experiment"] == "kv_cache"].set_index("group")
    # Groups used to be the preset alone, so L4's k6 beat every H100 run; now each machine class
    # is its own group, and the two H100 hosts (k1 on host-a, k2/k5 on host-b) compete.
    assert kv.loc[H100, "run_id"] == "k2"  # highest tokens/s, ok rows only, earliest tie
    assert kv.loc[H100, ["participant", "team", "machine", "preset", "variant"]].tolist() == [
        "ben", "BEN", "NVIDIA H100", "small", "paged"]
    assert kv.loc[H100, "date"] == "2026-01-01T10:00:00+00:00"
    assert kv.loc[H100, "entries"] == 3  # k1, k2, k5 (k3 was an OOM)
    assert kv.loc["small, 1 rank, float32, NVIDIA L4", "run_id"] == "k6"
    assert kv.loc["medium, 1 rank, float32, NVIDIA H200", "run_id"] == "k4"
    ck = best[best["experiment"] == "checkpointing"].set_index("group")
    # lowest peak memory, compared only at the same batch: c2's smaller batch is its own group
    eight = f"small, batch_size=8, seq_len=512, 1 rank, float32, CPU {CPU}"
    assert ck.loc[eight, "run_id"] == "c1" and ck.loc[eight, "entries"] == 2
    assert ck.loc[eight, "settings"] == "batch_size=8, seq_len=512"
    assert ck.loc[f"small, batch_size=4, seq_len=512, 1 rank, float32, CPU {CPU}", "run_id"] == "c2"
    zero = best[best["experiment"] == "zero"]
    assert zero["value"].tolist() == [2e9]  # rank 0's number
    nobody = best[best["experiment"] == "batching"]
    assert nobody["entries"].tolist() == [0] and nobody["run_id"].isna().all()
    assert set(lb.PROVENANCE) <= set(best.columns)
    assert list(best["challenge"].drop_duplicates()) == [c.name for c in lb.CHALLENGES]


# ---- fair groups: what used to win by doing less work ----------------------------------------

def test_a_one_layer_model_does_not_beat_the_tiny_runs_in_the_leanest_training_step():
    same = {"batch_size": 8, "seq_len": 64, "preset": "tiny"}
    rows = [_result("t1", "ana", "checkpointing", "full", "peak_mem_bytes", 3e8, **same),
            _result("t2", "ben", "checkpointing", "selective", "peak_mem_bytes", 2e8, **same),
            _result("s1", "cy", "checkpointing", "none", "peak_mem_bytes", 5e7, model={"num_layers": 1},
                    **same)]  # a quarter of tiny's 4 layers: less memory, no better technique
    ck = _best(rows, "checkpointing")
    assert sorted(ck["run_id"]) == ["s1", "t2"]  # one winner per group: s1 beats nobody
    tiny = f"tiny, batch_size=8, seq_len=64, 1 rank, float32, CPU {CPU}"
    assert ck.loc[tiny, "run_id"] == "t2" and ck.loc[tiny, "entries"] == 2
    shallow = f"tiny, num_layers=1, batch_size=8, seq_len=64, 1 rank, float32, CPU {CPU}"
    assert ck.loc[shallow, "run_id"] == "s1" and ck.loc[shallow, "entries"] == 1
    # every model field is held fixed, not only the preset name and num_layers
    wide = _result("w1", "dee", "checkpointing", "none", "peak_mem_bytes", 1e7,
                   model={"ffn_size": 64, "rope_theta": 500000.0}, **same)
    assert len(_best([*rows, wide], "checkpointing")) == 3
    # the side-by-side tables keep shapes apart too: one layer is its own technique row
    table = lb.side_by_side(lb.board(pd.DataFrame([*rows, wide])), "peak_mem_bytes")
    assert sorted(table.index) == ["checkpointing/full", "checkpointing/none (ffn_size=64, "
                                   "rope_theta=500000.0)", "checkpointing/none (num_layers=1)",
                                   "checkpointing/selective"]


def test_a_four_rank_zero_run_does_not_beat_the_two_rank_runs():
    rows = [_result("a", "ana", "zero", "zero1", "peak_mem_bytes", 2.0e9, nproc=2),
            _result("b", "ben", "zero", "zero3", "peak_mem_bytes", 1.5e9, nproc=2),
            _result("c", "cy", "zero", "zero3", "peak_mem_bytes", 0.8e9, nproc=4)]  # 1/4 per rank
    zero = _best(rows, "zero")
    assert sorted(zero["run_id"]) == ["b", "c"]  # c wins only among 4-rank runs
    two = f"small, batch_size=None, seq_len=None, 2 ranks, float32, CPU {CPU}"
    assert zero.loc[two, "run_id"] == "b" and zero.loc[two, "entries"] == 2
    assert zero.loc[two.replace("2 ranks", "4 ranks"), "run_id"] == "c"
    # a row that stored no nproc ran in one process
    one = _result("d", "dee", "zero", "zero3", "peak_mem_bytes", 9e9)
    assert "1 rank, float32" in _best([one], "zero").index[0]


def test_a_bf16_run_and_an_fp32_run_sit_in_different_groups():
    rows = [_result("f", "ana", "kv_cache", "paged", "tokens_per_s", 900.0, gpu="NVIDIA H100"),
            _result("h", "ben", "kv_cache", "paged", "tokens_per_s", 2000.0, gpu="NVIDIA H100",
                    dtype="bf16")]  # an alias: the same group as bfloat16
    kv = _best(rows, "kv_cache")
    assert sorted(kv["run_id"]) == ["f", "h"]
    assert kv.loc[H100, "run_id"] == "f"
    assert kv.loc[H100.replace("float32", "bfloat16"), "run_id"] == "h"


def test_two_machines_of_one_class_compete_two_classes_do_not():
    rows = [_result("a", "ana", "matmul", "bf16", "tflops", 50.0, host="laptop-1", num_cores=8),
            _result("b", "ben", "matmul", "bf16", "tflops", 60.0, host="laptop-2", num_cores=16),
            _result("g", "cy", "matmul", "bf16", "tflops", 600.0, gpu="NVIDIA H200")]
    mm = _best(rows, "matmul")
    assert sorted(mm["run_id"]) == ["b", "g"]  # the CPU's best, and the GPU's
    cpu = f"small, 1 rank, float32, CPU {CPU}"  # the CPU model, not the host or its core count
    assert mm.loc[cpu, "run_id"] == "b" and mm.loc[cpu, "entries"] == 2
    assert mm.loc["small, 1 rank, float32, NVIDIA H200", "entries"] == 1
    assert lb.machine_class(_env(None, num_cores=8)) == lb.machine_class(_env(None, num_cores=16))
    gpu_env = _env("NVIDIA H200")
    assert lb.machine_class(gpu_env) == "NVIDIA H200"
    assert lb.machine_class(gpu_env, "cpu") == "CPU ?"  # a CPU run on a GPU host is a CPU run


def test_the_group_label_of_a_resolved_config_shows_only_what_differs_from_the_preset():
    plain = resolve(RunConfig, "tiny", {"device": "cpu"}).params()
    shallow = resolve(RunConfig, "tiny", {"device": "cpu", "num_layers": 1}).params()
    assert lb.comparison_group(plain, "CPU X") == "tiny, 1 rank, float32, CPU X"
    assert lb.comparison_group(shallow, "CPU X", ("batch_size",)) == (
        f"tiny, num_layers=1, batch_size={shallow['batch_size']}, 1 rank, float32, CPU X")
    assert lb.shape_changes({"preset": "tiny"}) == ["shape not recorded"]
    assert lb.setup(plain) == "" and lb.setup(shallow) == "num_layers=1"
    assert lb.setup({**plain, "nproc": 2, "dtype": "bf16"}) == "2 ranks, bfloat16"


def test_side_by_side_by_machine_and_by_participant(room):
    table = lb.side_by_side(room, "tokens_per_s", by="machine")
    assert table.loc["kv_cache/paged", "NVIDIA L4"] == 3000.0
    assert table.loc["kv_cache/paged", "NVIDIA H200"] == 9000.0
    assert table.loc["kv_cache/paged", "NVIDIA H100"] == 1200.0  # cy's OOM is no result
    assert table.loc["kv_cache/static", "NVIDIA H100"] == 900.0
    mem = lb.side_by_side(room, "peak_mem_bytes", by="participant")
    # a technique's row names what it changed beyond the preset: ZeRO at 2 ranks is its own row
    assert mem.loc["checkpointing/full", "ana"] == 3e9 and mem.loc["zero/zero3 (2 ranks)", "ana"] == 2e9
    entries = lb.entries(room, "peak_mem_bytes")
    assert set(lb.PROVENANCE) <= set(entries.columns) and len(entries) == 4
    with pytest.raises(ConfigError, match="unknown metric 'speed'; valid: tokens_per_s"):
        lb.entries(room, "speed")
    assert lb.better("step_ms") == "min" and lb.better("tflops") == "max"
    assert lb.figure(room, "tokens_per_s").data  # bars drawn
    empty = lb.board(load_results(Path("/nonexistent")))
    assert lb.side_by_side(empty).empty and len(lb.best_per_challenge(empty)) == len(lb.CHALLENGES)


# ---- the learning view -----------------------------------------------------------------------

def _attempt(i, participant, exercise, topic, correct, minute, team="red"):
    return {"attempt_id": f"a{i}", "timestamp": f"2026-01-01T10:{minute:02d}:00+00:00",
            "exercise": exercise, "topic": topic, "level": 1, "correct": correct,
            "prediction": "x", "reference": "y", "participant": participant, "team": team,
            "machine": "CPU X", "device": "cpu", "run_id": None}


@pytest.fixture
def attempts() -> pd.DataFrame:
    return pd.DataFrame([
        _attempt(1, "ana", "m1", "memory", True, 5),  # listed first, but ana's second try at m1
        _attempt(2, "ana", "m1", "memory", False, 1),
        _attempt(3, "ana", "m2", "memory", True, 2),
        _attempt(4, "ana", "p1", "parallelism", False, 3),
        _attempt(5, "ben", "m1", "memory", True, 1),
        _attempt(6, "ben", "p1", "parallelism", False, 2),
        _attempt(7, "ben", "p1", "parallelism", False, 4),
    ])


def _pick(view: pd.DataFrame, who: str, topic: str, by: str = "participant") -> list:
    row = view[(view[by] == who) & (view["topic"] == topic)]
    assert len(row) == 1, (who, topic)
    return row[lb.LEARNING_COLUMNS].iloc[0].tolist()


def test_the_learning_view_counts_attempts_accuracy_and_first_tries(attempts):
    view = lb.learning_view(attempts)
    # attempts, correct, accuracy %, exercises tried, first-try accuracy % (m1 wrong, m2 right)
    assert _pick(view, "ana", "memory") == [3, 2, 66.7, 2, 50.0]
    assert _pick(view, "ana", "parallelism") == [1, 0, 0.0, 1, 0.0]
    assert _pick(view, "ana", lb.ALL_TOPICS) == [4, 2, 50.0, 3, 33.3]
    assert _pick(view, "ben", lb.ALL_TOPICS) == [3, 1, 33.3, 2, 50.0]
    assert _pick(view, lb.EVERYONE, lb.ALL_TOPICS) == [7, 3, 42.9, 3, 40.0]  # 2 of 5 first tries
    assert len(view) == 4 + 2 + 1
    # by team: first tries stay per person (ana's and ben's first m1 both count): 2 of 3
    team = lb.learning_view(attempts, by="team")
    assert _pick(team, "red", "memory", "team") == [4, 3, 75.0, 2, 66.7]
    with pytest.raises(ConfigError, match="unknown by 'machine'; valid: participant, team"):
        lb.learning_view(attempts, by="machine")


def test_the_hardest_exercises_come_first(attempts):
    hard = lb.hardest_exercises(attempts)
    assert hard["exercise"].tolist() == ["p1", "m1", "m2"]
    assert hard.iloc[0][["topic", "people", "attempts", "correct", "accuracy_pct"]].tolist() == [
        "parallelism", 2, 3, 0, 0.0]
    assert hard.iloc[1][["accuracy_pct", "first_try_accuracy_pct"]].tolist() == [66.7, 50.0]


def test_the_learning_view_copes_with_no_attempts_and_missing_names():
    for empty in (pd.DataFrame(), pd.DataFrame(columns=["exercise", "topic", "correct"])):
        assert lb.learning_view(empty).empty and lb.hardest_exercises(empty).empty
        assert list(lb.learning_view(empty, "team").columns) == ["team", "topic", *lb.LEARNING_COLUMNS]
    nameless = pd.DataFrame([_attempt(1, None, "m1", "memory", None, 1, team="")])
    view = lb.learning_view(nameless)
    assert _pick(view, lb.UNNAMED, "memory") == [1, 0, 0.0, 1, 0.0]  # no verdict is not correct


def test_a_diagnosis_and_a_fix_are_two_first_tries_at_one_exercise():
    rows = [{**_attempt(1, "ana", "t1", "memory", False, 1), "kind": "diagnosis"},
            {**_attempt(2, "ana", "t1", "memory", True, 2), "kind": "diagnosis"},
            {**_attempt(3, "ana", "t1", "memory", True, 3), "kind": "fix"}]
    assert _pick(lb.learning_view(pd.DataFrame(rows)), "ana", "memory") == [3, 2, 66.7, 1, 50.0]


def test_the_learning_view_reads_the_attempts_the_exercises_store(tmp_path):
    attempts = pytest.importorskip("labkit.study.exercises.attempts")
    assert lb.learning_view(lb.load_learning(tmp_path)).empty  # nobody has answered yet
    for i, correct in enumerate((False, True)):
        attempts.record_attempt(kind="exercise", exercise="m1", topic="memory", level=1,
                                prediction=i, reference=1, correct=correct, measured={},
                                device="cpu", run_id=None, folder=tmp_path, participant="ana",
                                team="red")
    view = lb.learning_view(lb.load_learning(tmp_path))
    assert _pick(view, "ana", "memory") == [2, 1, 50.0, 1, 0.0]
    assert lb.board(load_results(tmp_path)).empty  # attempts are not runs


# ---- the live panel --------------------------------------------------------------------------

def _store(folder: Path, run_id: str, participant: str) -> None:
    rec = RunRecord("kv_cache", env={}, config={"participant": participant}, directory=folder,
                    run_id=run_id)
    rec.add([{"variant": "v", "params": {"participant": participant}, "metric": "tokens_per_s",
              "value": 1.0, "unit": unit_of("tokens_per_s"), "predicted": None, "status": "ok",
              "message": "", "rank": 0}])
    rec.finish()


def test_the_live_panel_reads_the_shared_folder_again_on_refresh(tmp_path, capsys, monkeypatch,
                                                                  attempts):
    pytest.importorskip("ipywidgets")
    panel = lb.leaderboard_panel(tmp_path, "tokens_per_s")
    (view, pick, by, refresh), _ = panel.children[0].children, panel.children[1]
    assert pick.value == "tokens_per_s" and by.options == ("machine", "participant", "team")
    assert view.options == ("runs", "learning") and view.value == "runs"
    _store(tmp_path, "r-late", participant="zoe")  # a participant's run lands in the folder
    capsys.readouterr()
    refresh.click()
    assert "zoe" in capsys.readouterr().out  # outside a kernel, display() prints
    # the learning view reads the attempts again (the store's loader is stubbed with a built frame)
    monkeypatch.setattr(lb, "load_learning", lambda runs_dir: attempts)
    view.value = "learning"
    out = capsys.readouterr().out
    assert lb.EVERYONE in out and "first_try_accuracy_pct" in out and pick.disabled
    monkeypatch.setattr(lb, "load_learning", lambda runs_dir: pd.DataFrame())
    refresh.click()
    assert "no exercise attempts yet" in capsys.readouterr().out
    with pytest.raises(ConfigError, match="unknown metric"):
        lb.leaderboard_panel(tmp_path, "speed")
