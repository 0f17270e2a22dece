"""The recipe panel, headless: values are set and Run pressed in code. The plan, the verdict, the
refusal and the recommendation are held to the planner's and refusal()'s own answers; Run goes
through a stub runner (what it is asked to run, what it shows), and once for real on two gloo
ranks at the smallest size."""
from __future__ import annotations

import dataclasses
import json

import pytest

from labkit import planner
from labkit.blocks import hf
from labkit.blocks.recipe import Recipe, refusal
from labkit.config import MODELS, resolve
from labkit.harness.ranks import RunFailed
from labkit.results import RunResult
from labkit.techniques import recipe as experiment
from labkit.ui import recipe_panel as rp
from labkit.ui.recipe_panel import RecipePanel

GIB = 2**30
SMALL = {"model": "small", "batch_size": 8, "seq_len": 512, "num_gpus": 4, "gpu_mem_gib": 8.0}
RECIPE = {"precision": "bf16", "checkpointing": "full", "micro_batches": 2, "zero_stage": 2}


def planned_small(**kw) -> planner.MemoryPlan:
    """The planner's own call for the `small` preset at SMALL's sizes on 4 GPUs (cuda)."""
    args = dict(batch_size=8, seq_len=512, precision="fp32", optimizer="adamw", zero_stage=0,
                gpus=4, checkpointing="none", accumulation_steps=1, device="cuda")
    return planner.training_memory(MODELS["small"], **{**args, **kw})


def test_changing_a_knob_changes_the_plan_and_the_verdict_as_the_planner_says():
    panel = RecipePanel(**SMALL)
    plain = planned_small()
    assert panel.plan.total_bytes == plain.total_bytes and panel.error is None
    # bf16 (FSDP2's mixed-precision policy under ZeRO-2), full recomputation, 2 micro-batches of 4
    panel.set(**RECIPE)
    composed = planned_small(batch_size=4, accumulation_steps=2, precision="bf16",
                             checkpointing="full", zero_stage=2, fsdp2=True)
    assert panel.plan.total_bytes == composed.total_bytes < plain.total_bytes
    assert list(panel.plan_table()["bytes"])[-1] == composed.total_bytes
    # a memory between the two peaks: the recipe fits, plain does not; by the planner's margins
    mem = (composed.total_bytes + plain.total_bytes) / 2 / GIB
    panel.set(gpu_mem_gib=mem)
    assert panel.fits and f"fits, {rp.gib(int(mem * GIB) - composed.total_bytes)} to spare" in panel.verdict
    panel.set(precision="fp32", checkpointing="none", micro_batches=1, zero_stage=0)
    assert panel.fits is False
    assert f"does NOT fit: {rp.gib(plain.total_bytes - int(mem * GIB))} over" in panel.verdict
    assert panel.verdict in panel.lines()


def test_the_plan_is_for_gpus_not_this_machine():
    # a short sequence: the peak is the optimizer step, where torch's default AdamW differs
    # (CUDA's multi-tensor copy of every v; the CPU's for-loop temporaries)
    panel = RecipePanel(**{**SMALL, "batch_size": 1, "seq_len": 8})
    cuda, cpu = (planned_small(batch_size=1, seq_len=8, device=d) for d in ("cuda", "cpu"))
    assert panel.cfg.device == "cuda" and panel.plan.peak_phase == "step"
    assert panel.plan.total_bytes == cuda.total_bytes != cpu.total_bytes


def test_every_n_and_the_gpu_count_reach_the_planner():
    panel = RecipePanel(**{**SMALL, "checkpointing": "every_n", "checkpoint_every": 3, "num_gpus": 2})
    # every 3rd of small's 12 blocks: 4 blocks recomputed in full, over 2 DDP ranks
    expected = planned_small(checkpointing="full", checkpointed_layers=4, gpus=2)
    assert panel.plan.total_bytes == expected.total_bytes


def test_a_qlora_recipe_reaches_the_planners_fine_tuning_step_on_its_ranks():
    panel = RecipePanel(**{**SMALL, "finetune": "qlora", "checkpointing": "full", "zero_stage": 2})
    expected = planner.finetune_memory(MODELS["small"], method="qlora", batch_size=8, seq_len=512,
                                       checkpointing="full", device="cuda", zero_stage=2, gpus=4)
    assert panel.plan.total_bytes == expected.total_bytes and panel.plan.gathered_bytes > 0
    assert "finetune=qlora" in panel.header()
    bf16 = RecipePanel(**{**SMALL, "finetune": "lora", "precision": "bf16"})
    assert bf16.plan is None and "fine-tuning steps compute in one dtype" in bf16.not_planned


def test_offload_and_compile_are_not_planned_and_say_why():
    panel = RecipePanel(**SMALL, compile=True)
    assert panel.plan is None and panel.not_planned == "the planner does not model offload or compile"
    assert f"not planned: {panel.not_planned}" in panel.lines()


@pytest.mark.parametrize("knobs, recipe, world", [
    ({"precision": "bf16_weights", "zero_stage": 1}, Recipe(precision="bf16_weights", zero_stage=1), 4),
    ({"precision": "fp16", "offload": "optimizer"}, Recipe(precision="fp16", offload="optimizer",
                                                           zero_stage=0), 4),
])
def test_a_refused_combination_shows_its_refusal_line(knobs, recipe, world):
    panel = RecipePanel(**SMALL, **knobs)
    line = refusal(recipe, "cuda", world, launched=True)
    assert line and panel.refusal == line and panel.plan is None and panel.error is None
    assert f"refused: {line}" in panel.lines()
    assert panel.recommended is not None  # the way out is still shown


def test_zero_on_one_gpu_is_the_experiments_refusal():
    panel = RecipePanel(**{**SMALL, "num_gpus": 1, "zero_stage": 2})
    assert panel.refusal == experiment.refused(panel.cfg) and "use zero_stage=0" in panel.refusal


def test_a_bad_hugging_face_folder_is_one_line_and_a_good_one_is_planned(tmp_path):
    panel = RecipePanel(**SMALL, hf_model=str(tmp_path / "missing"))
    assert panel.plan is None and panel.lines() == [f"error: {panel.error}"]
    assert "no such folder" in panel.error and "\n" not in panel.error
    (tmp_path / "config.json").write_text("{not json")
    panel.set(hf_model=str(tmp_path))
    assert "not a readable JSON file" in panel.error and "\n" not in panel.error
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    panel.set(hf_model=str(tmp_path))
    assert panel.error.startswith("model_type 'bert' is not supported")
    qwen2 = {"model_type": "qwen2", "hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 300,
             "max_position_embeddings": 1024}
    (tmp_path / "config.json").write_text(json.dumps(qwen2))
    panel.set(hf_model=str(tmp_path), seq_len=256)
    shape = hf.model_config(tmp_path)
    assert panel.error is None and panel.cfg.model == shape
    assert panel.plan.total_bytes == planner.training_memory(
        shape, batch_size=8, seq_len=256, gpus=4, device="cuda").total_bytes
    assert panel.header().startswith(f"{shape.source}: ")


def test_bad_sizes_are_one_line_too():
    panel = RecipePanel(**SMALL, micro_batches=3)
    assert panel.error == "micro_batches=3 must divide batch_size=8 (each rank's batch is split)"
    panel.set(micro_batches=1, gpu_mem_gib=0)
    assert "gpu_mem_gib=0 must be a positive number" in panel.error


@pytest.mark.parametrize("mem_gib", [8.0, 3.0, 1.2, 0.9])
def test_the_recommended_recipe_fits_and_is_the_first_in_the_search_order(mem_gib):
    panel = RecipePanel(**{**SMALL, "gpu_mem_gib": mem_gib})
    rec, mem = panel.recommended, int(mem_gib * GIB)
    assert rec.fits and rec.source == "recipe search"
    cfg = dataclasses.replace(panel.cfg, **rec.changes)
    assert experiment.refused(cfg) is None
    assert experiment.planned(cfg).total_bytes == rec.total_bytes <= mem  # the planner's check
    # cheapest first: ZeRO 0-2 before recomputation (selective before full), ZeRO-3 last
    pairs = [(c, z) for c in ("none", "selective", "full") for z in (0, 1, 2)] + \
        [(c, 3) for c in ("none", "selective", "full")]
    order = [(p, c, z) for p in ("fp32", "bf16", "bf16_weights") for c, z in pairs]
    chosen = order.index((rec.changes["precision"], rec.changes["checkpointing"], rec.changes["zero_stage"]))
    for precision, ckpt, zero in order[:chosen]:  # nothing earlier fits at any split
        for k in (1, 2, 4, 8):
            earlier = dataclasses.replace(panel.cfg, precision=precision, checkpointing=ckpt,
                                          zero_stage=zero, micro_batches=k)
            assert experiment.refused(earlier) or experiment.planned(earlier).total_bytes > mem
    fewer = [k for k in (1, 2, 4, 8) if k < rec.changes["micro_batches"]]
    for k in fewer:  # the fewest micro-batches that fit
        assert experiment.planned(dataclasses.replace(cfg, micro_batches=k)).total_bytes > mem
    if mem_gib == 8.0:  # plain already fits
        assert rec.changes == {"precision": "fp32", "checkpointing": "none", "zero_stage": 0,
                               "micro_batches": 1} and "your recipe fits as it is" in rec.reason


def test_when_no_recipe_fits_the_planners_recommendation_is_shown():
    panel = RecipePanel()  # llama-2-7b, 8 x 4096 tokens per GPU on 4 x 24 GiB: 16 B/param > 24 GiB / 4
    rec = panel.recommended
    expected = planner.recommend(MODELS["llama-2-7b"], effective_batch=32, seq_len=4096, gpus=4,
                                 gpu_mem_bytes=24 * GIB, device="cuda")
    assert rec.source == "planner.recommend" and rec.fits == expected.fits
    assert rec.total_bytes == expected.total_bytes and rec.changes["precision"] == expected.precision
    assert rp.recommendation_line(rec) in panel.lines()


# --- Run ------------------------------------------------------------------------------------------

def row(variant, metric, rank, value, predicted=None, status="ok", message=""):
    return {"variant": variant, "metric": metric, "rank": rank, "value": value, "predicted": predicted,
            "status": status, "message": message, "unit": "bytes", "params": {}}


class Stub:
    """A runner that records what it was asked and answers `rows` (or raises `error`)."""

    def __init__(self, rows=(), error=None):
        self.rows, self.error, self.calls = list(rows), error, []

    def __call__(self, name, **kwargs):
        self.calls.append((name, kwargs))
        if self.error is not None:
            raise self.error
        return RunResult("stub", "", self.rows)


def test_run_asks_for_the_recipe_at_this_machines_size_with_a_scaled_budget():
    stub = Stub([row("composed", "peak_mem_bytes", r, 10.0 * 2**20, 11.0 * 2**20) for r in (0, 1)]
                + [row("plain", "peak_mem_bytes", 0, 20.0 * 2**20, 19.0 * 2**20)])
    panel = RecipePanel(runner=stub, **SMALL, **RECIPE)
    panel.run()
    (name, kwargs), = stub.calls
    o = kwargs["overrides"]
    assert name == "recipe" and kwargs["preset"] == "tiny" and o["device"] == "cpu" and o["nproc"] == 2
    assert {k: o[k] for k in RECIPE} == RECIPE and o["batch_size"] == rp.RUN_MICRO_BATCH * 2
    run_cfg = resolve(experiment.Config, "tiny", {**o, "variant": "composed"}, experiment="recipe")
    ratio = 8.0 * GIB / panel.plan.total_bytes  # the GPU memory over the chosen recipe's peak
    assert o["budget_gib"] * GIB == pytest.approx(experiment.planned(run_cfg).total_bytes * ratio)
    table = panel.rows_table()
    peaks = table[table["metric"] == "peak_mem_bytes"]
    assert list(zip(peaks["variant"], peaks["rank"])) == [("composed", 0), ("composed", 1), ("plain", 0)]
    assert list(peaks["measured_over_predicted"]) == [round(10 / 11, 3), round(10 / 11, 3), round(20 / 19, 3)]
    assert panel.run_error is None and "rank 1 peak 10 MiB measured, 11 MiB predicted" in panel.run_line


def test_one_gpu_runs_on_one_rank_and_the_budget_can_be_off():
    stub = Stub([row("composed", "peak_mem_bytes", 0, 1.0, 1.0)])
    panel = RecipePanel(runner=stub, **{**SMALL, "num_gpus": 1, "scaled_budget": False})
    panel.run()
    o = stub.calls[0][1]["overrides"]
    assert o["nproc"] == 1 and "budget_gib" not in o


def test_on_a_gpu_the_run_is_the_chosen_sizes_and_the_budget_the_gpus_memory(monkeypatch):
    monkeypatch.setattr(rp.hardware, "available_devices", lambda: ["cpu", "cuda"])
    monkeypatch.setattr(rp.hardware, "gpu_info", lambda: [object()])  # one GPU present
    stub = Stub([row("composed", "peak_mem_bytes", 0, 1.0, 1.0)])
    panel = RecipePanel(runner=stub, **{**SMALL, "num_gpus": 1, "precision": "bf16",
                                        "checkpointing": "full", "micro_batches": 2})
    panel.run()
    (_, kwargs), = stub.calls
    o = kwargs["overrides"]
    assert kwargs["preset"] == "small" and o["device"] == "cuda" and o["nproc"] == 1
    assert (o["batch_size"], o["seq_len"]) == (8, 512) and "num_layers" not in o
    # the run is the chosen recipe itself: its scaled budget is the GPU memory chosen
    assert o["budget_gib"] == pytest.approx(SMALL["gpu_mem_gib"])


def test_oom_errors_and_crashes_are_rows_and_lines_never_tracebacks():
    oom = "over the 1.0 MiB budget: peak 31.1 MiB on the busiest rank"
    panel = RecipePanel(runner=Stub([row("plain", "peak_mem_bytes", 0, 5.0, 5.0),
                                     row("composed", None, 0, None, status="oom", message=oom),
                                     row("composed", None, 1, None, status="oom", message=oom)]), **SMALL)
    panel.run()
    table = panel.rows_table()
    assert list(table["status"]) == ["ok", "oom", "oom"] and f"composed oom: {oom}" in panel.run_line
    crashed = RunFailed("the run ended early: rank 1 exited with code -9\nmore", RunResult("x", "", [
        row("plain", "peak_mem_bytes", 0, 5.0, 5.0)]))
    panel.runner = Stub(error=crashed)
    panel.run()
    assert panel.run_error == "the run ended early: rank 1 exited with code -9" and len(panel.frame) == 1
    panel.runner = Stub(error=RuntimeError("the store is full"))
    panel.run()
    assert panel.run_line == "error: RuntimeError: the store is full" and panel.frame is None
    panel.set(hf_model="/no/such/folder")
    panel.run()
    assert panel.run_line.startswith("error: --hf-model /no/such/folder: no such folder")


@pytest.mark.multiprocess
def test_run_for_real_on_two_cpu_ranks_shows_measured_beside_predicted(tmp_path):
    # A 4 GiB GPU for the small recipe: it fits with room, so the scaled budget lets composed run.
    panel = RecipePanel(runs_dir=str(tmp_path), **{**SMALL, **RECIPE, "gpu_mem_gib": 4.0})
    assert panel.fits
    panel.start()
    assert panel.wait(120) and panel.run_error is None, panel.run_line
    table = panel.rows_table()
    peaks = table[(table["variant"] == "composed") & (table["metric"] == "peak_mem_bytes")]
    assert list(peaks["rank"]) == [0, 1] and set(peaks["status"]) == {"ok"}
    _, o = panel.run_overrides()
    run_cfg = resolve(experiment.Config, "tiny", {**o, "variant": "composed"}, experiment="recipe")
    assert set(peaks["predicted"]) == {experiment.planned(run_cfg).total_bytes}
    assert {"param_bytes", "grad_bytes", "tokens_per_s", "loss_delta"} <= set(table["metric"])
    assert "rank 0 peak" in panel.run_line and len(list(tmp_path.glob("*.json"))) == 1


# --- the widget view ------------------------------------------------------------------------------

def test_the_view_redraws_on_every_change_and_runs_with_the_button():
    W = pytest.importorskip("ipywidgets")
    pytest.importorskip("plotly")
    stub = Stub([row("composed", "peak_mem_bytes", 0, 10.0 * 2**20, 11.0 * 2**20)])
    box = rp.recipe_panel(runner=stub, **SMALL)
    panel, controls = box.panel, box.controls
    assert isinstance(box, W.VBox) and isinstance(controls["precision"], W.Dropdown)
    assert list(controls["precision"].options) == list(experiment.PRECISIONS)  # the config's choices
    plan_out, run_out = box.children[1], box.children[3]
    controls["zero_stage"].value = 2
    assert panel.values["zero_stage"] == 2
    assert panel.plan.total_bytes == planned_small(zero_stage=2, fsdp2=True).total_bytes
    text = plan_out.outputs[0]["data"]["text/plain"]
    assert panel.verdict in text and "application/vnd.plotly.v1+json" in plan_out.outputs[1]["data"]
    controls["hf_model"].value = "/no/such/folder"
    assert plan_out.outputs[0]["data"]["text/plain"].startswith("error: --hf-model")
    assert len(plan_out.outputs) == 1
    controls["hf_model"].value = ""
    box.run_button.click()
    assert panel.wait(30) and stub.calls
    assert "11 MiB" in run_out.outputs[1]["data"]["text/plain"]
