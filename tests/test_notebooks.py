"""Each notebook is executed by papermill with small CPU parameters, as a report would be."""
import json
from pathlib import Path

import pytest

from conftest import FAST, TINY_DECODE, TINY_DIST, TINY_TRAIN

papermill = pytest.importorskip("papermill")

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
PARAMETERS = {
    "00_environment.ipynb": {},
    "01_mixed_precision.ipynb": {"overrides": {**TINY_TRAIN, "batch_size": 2}, "variants": "bf16_weights"},
    "02_kv_cache.ipynb": {"overrides": TINY_DECODE},
    "03_checkpointing.ipynb": {"overrides": {**FAST, "batch_size": 1, "seq_len": 8, "num_layers": 2}},
    "04_grad_accumulation.ipynb": {"overrides": {**FAST, "batch_size": 1, "seq_len": 8, "num_layers": 2},
                                   "sweep": {"micro_batches": [1, 2]}},
    "05_offload.ipynb": {"overrides": TINY_TRAIN},
    "06_memory_pool.ipynb": {"overrides": {**FAST, "num_layers": 2, "prompt_len": 8, "new_tokens": 6,
                                           "batch_size": 1}},
    "07_batch_finder.ipynb": {"overrides": {**FAST, "num_layers": 2, "mode": "dynamic"}, "seq_lens": [16, 32],
                              "cpu_budget_gib": 0.062, "variants": "fp32_ckpt"},
    "08_memory_planner.ipynb": {"check_overrides": {**TINY_TRAIN, "batch_size": 2}, "device": "cpu"},
    "09_collectives.ipynb": {"overrides": {**FAST, "timed_steps": 1}, "sweep": {"message_bytes": [4096]},
                             "variants": "all_gather", "nproc": 2},
    "10_data_parallel.ipynb": {"overrides": TINY_DIST, "variants": "ddp", "nproc": 2},
    "11_zero.ipynb": {"overrides": TINY_DIST, "variants": "zero3", "nproc": 2},
    "12_tensor_parallel.ipynb": {"overrides": TINY_DIST, "variants": "tp", "nproc": 2},
    "13_pipeline_parallel.ipynb": {"overrides": TINY_DIST, "sweep": {"micro_batches": [2]},
                                   "variants": "gpipe", "nproc": 2},
    "14_hybrid.ipynb": {"overrides": {**TINY_DIST, "batch_size": 4, "num_layers": 1, "timed_steps": 1},
                        "variants": "fsdp_tp", "nproc": 4},
    "15_load_balance.ipynb": {"overrides": {**TINY_DIST, "calibration_steps": 1}, "nproc": 2},
    "16_batching.ipynb": {"overrides": {"num_requests": 6, "max_output_len": 12, "arrival": "closed",
                                        "batch_size": 3, "num_layers": 2}, "variants": "continuous"},
    "17_attention.ipynb": {"overrides": {**FAST, "batch_size": 1, "hidden_size": 64, "num_heads": 4,
                                         "num_kv_heads": 2}, "sweep": {"seq_len": [64, 128]}, "variants": "sdpa"},
    "18_compile.ipynb": {"overrides": {**FAST, "num_layers": 1, "hidden_size": 32, "num_heads": 2,
                                       "num_kv_heads": 1, "ffn_size": 64, "vocab_size": 64,
                                       "batch_size": 2, "seq_len": 8, "prompt_len": 4,
                                       "decode_steps": 4, "probe_calls": 2, "inductor_cache": True},
                         "variants": "default"},
    "19_fused_kernel.ipynb": {"overrides": {**FAST, "hidden_size": 96}, "sweep": {"rows": [64]},
                              "variants": "triton"},
    "20_matmul.ipynb": {"overrides": {**FAST, "size": 128}},
    "21_memory_access.ipynb": {"overrides": {**FAST, "size_mib": 1}, "sweep": {"stride": [2, 4]}},
    "22_profiling.ipynb": {"overrides": {**TINY_TRAIN, "overhead_repeats": 1, "memory_timeline": False},
                           "variants": "profiler"},
    "23_dataloading.ipynb": {"overrides": {**FAST, "batch_size": 2, "seq_len": 16, "num_layers": 2,
                                           "steps": 2, "sample_cost_us": 5000.0, "epoch_steps": 50,
                                           "min_run_time_s": 0.1},
                             "variants": "workers"},
    "24_threads.ipynb": {"overrides": {**FAST, "size": 128, "threads": 2}, "variants": "set_num_threads,omp_env"},
    "99_compare.ipynb": {"price_per_gpu_hour": 2.0},
}


def test_every_notebook_is_covered_committed_clean_with_one_parameters_cell():
    assert sorted(p.name for p in NOTEBOOKS.glob("*.ipynb")) == sorted(PARAMETERS)
    for path in NOTEBOOKS.glob("*.ipynb"):
        cells = json.loads(path.read_text())["cells"]
        assert not any(c.get("outputs") for c in cells), path
        tagged = [c for c in cells if "parameters" in c["metadata"].get("tags", [])]
        assert len(tagged) == 1, path


def outputs_of(nb: dict) -> list[dict]:
    return [o for c in nb["cells"] for o in c.get("outputs", [])]


@pytest.mark.parametrize("name", sorted(PARAMETERS))
def test_notebook_runs_under_papermill(name, tmp_path):
    out = tmp_path / name
    papermill.execute_notebook(str(NOTEBOOKS / name), str(out), parameters=PARAMETERS[name],
                               kernel_name="python3", progress_bar=False, store_widget_state=False,
                               cwd=str(tmp_path))
    nb = json.loads(out.read_text())
    outputs = outputs_of(nb)
    assert not [o for o in outputs if o["output_type"] == "error"]
    text = json.dumps(outputs)
    assert "cpu" in text
    if name != "00_environment.ipynb":
        assert "application/vnd.plotly.v1+json" in text  # the comparison figure
        assert "predicted" in text and "measured" in text  # predicted beside measured
        assert "application/vnd.jupyter.widget-view+json" in text  # the panel
        assert out.stat().st_size < 1_000_000  # static figures, no embedded widget JavaScript
    else:
        assert "peak TFLOP/s" in text and "reason" in text
    if "nproc" in PARAMETERS[name]:  # a multi-process experiment: every rank's bars
        assert "rank 1" in text and "every rank" in text
