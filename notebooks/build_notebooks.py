"""Writes the notebooks in notebooks/ (thin: parameters, environment, run, figures, panel, notes).
Edit the cells here, then run `python notebooks/build_notebooks.py` (outputs are never committed)."""
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

ROOT = Path(__file__).resolve().parent
KERNEL = {"kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
          "language_info": {"name": "python"}}

EXPERIMENT_PARAMETERS = '''preset = None  # model shape and sizes: tiny, small, medium, gpt2-124m, ...; None: from the device
device = "auto"  # auto, cpu, cuda or cuda:N
variants = "all"  # comma-separated variants to run beside the reference, or "all"
overrides = {}  # any config field, e.g. {"batch_size": 8, "seq_len": 128}
interactive = True  # show the widget panel to re-run with other settings
runs_dir = None  # where results are stored (None: $LABKIT_RUNS_DIR or ./runs)'''


def experiment_notebook(name: str, title: str, intro: str, look_for: str) -> nbformat.NotebookNode:
    parameters = new_code_cell(EXPERIMENT_PARAMETERS, metadata={"tags": ["parameters"]})
    return new_notebook(metadata=KERNEL, cells=[
        new_markdown_cell(f"# {title}\n\n{intro}"),
        parameters,
        new_markdown_cell("## The machine"),
        new_code_cell("from labkit import hardware\n\nprint(hardware.describe())"),
        new_markdown_cell("## Run: the reference first, then each variant checked against it, measured, timed"),
        new_code_cell(
            "from labkit.experiment import run_experiment\n"
            "from labkit.widgets import build_panel, show_result\n\n"
            f'result = run_experiment("{name}", preset=preset, overrides={{**overrides, "device": device}},\n'
            '                        variants=None if variants == "all" else variants.split(","),\n'
            "                        runs_dir=runs_dir, progress=False)\n"
            "frame = result.frame()\n"
            f'show_result(frame, "{name}")'),
        new_markdown_cell("## Every measured number"),
        new_code_cell("from labkit import viz\n\nviz.metric_table(frame)"),
        new_markdown_cell("## Try other settings"),
        new_code_cell("if interactive:\n"
                      f'    display(build_panel("{name}", preset=preset, device=device,\n'
                      "                        overrides=overrides, runs_dir=runs_dir))"),
        new_markdown_cell(f"## What to look for\n\n{look_for}"),
    ])


ENVIRONMENT = new_notebook(metadata=KERNEL, cells=[
    new_markdown_cell(
        "# 00 · Your environment\n\nWhat the lab runs on: each device's architecture (multiprocessors, "
        "L2 cache, memory, compute capability, the dtypes its tensor cores take), its ceilings (the "
        "peak FLOP/s and bandwidth every measurement is compared with), the environment knobs that "
        "are set, and what the lab will do here."),
    new_code_cell('device = "auto"  # auto, cpu, cuda or cuda:N\npreset = None  # None: chosen from the device',
                  metadata={"tags": ["parameters"]}),
    new_code_cell("import pandas as pd\n\nfrom labkit import hardware\n\nprint(hardware.describe())"),
    new_markdown_cell("## Devices"),
    new_code_cell("pd.DataFrame(hardware.architecture())"),
    new_markdown_cell("## Ceilings\n\nGPUs: datasheet peaks from `data/gpus.json` (dense, no sparsity). "
                      "CPU: measured here by a short calibration, not a datasheet."),
    new_code_cell("from labkit.config import resolve_device\n\n"
                  "ceil = hardware.ceilings(resolve_device(device))\n"
                  "print(ceil.name, '|', ceil.source)\n"
                  "pd.DataFrame({'peak TFLOP/s': ceil.peak_tflops}).assign(\n"
                  "    **{'bandwidth GB/s': ceil.bandwidth_gbps,\n"
                  "       'ridge FLOP/byte': lambda t: t['peak TFLOP/s'] * 1e12 / ((ceil.bandwidth_gbps or float('nan')) * 1e9)})"),
    new_markdown_cell("## Environment knobs that change measurements"),
    new_code_cell("hardware.env_knobs() or 'none set'"),
    new_markdown_cell("## What the lab will do here"),
    new_code_cell("from labkit.experiment import lab_plan\n\npd.DataFrame(lab_plan(device, preset))"),
    new_markdown_cell(
        "## What to look for\n\n- **Ridge point** (peak FLOP/s / bandwidth): kernels with fewer FLOPs "
        "per byte than this are memory-bound. An H100 or H200 needs ~300 bf16 FLOP per byte of HBM "
        "traffic; a CPU core only a few.\n- **Tensor-core dtypes**: TF32 and bf16 need compute "
        "capability 8.0 (Ampere); fp8 needs 8.9 (Ada) or 9.0 (Hopper).\n- On a CPU, bf16 is fast "
        "only with AVX-512 BF16 or AMX; otherwise it is emulated and slower than fp32."),
])

NOTEBOOKS = {
    "00_environment.ipynb": ENVIRONMENT,
    "01_mixed_precision.ipynb": experiment_notebook(
        "mixed_precision", "01 · Mixed precision: fp32, TF32, fp16, bf16",
        "One training step of the model (AdamW) in each precision recipe. Each variant trains the "
        "same weights on the same batch for a few steps and its loss is compared with fp32 before "
        "anything is timed. You will see the memory each recipe needs (weights, optimizer state, "
        "activations saved for backward, by dtype) and its speed, beside the napkin math.",
        "- `param_bytes`: 4 bytes per parameter in fp32, **2** with `bf16_weights`: exactly half.\n"
        "- `optimizer_bytes`: AdamW keeps two fp32 moments (8 bytes per parameter); `bf16_weights` "
        "adds a 4-byte fp32 master copy (12 bytes): the weights got smaller, the optimizer bigger.\n"
        "- `activation_bytes` by dtype: autocast saves 16-bit copies of matmul inputs, but the "
        "residual stream, the norms and the loss stay fp32, so it shrinks by less than 2x; the "
        "16-bit copies of the weights are counted apart (`saved_weight_copy_bytes`) and can "
        "outweigh the saving at small batches.\n"
        "- `loss_delta`: the quality cost of each recipe after the same steps; fp16 rows carry "
        "GradScaler's `loss_scale` and the `skipped_steps`.\n"
        "- `step_ms` against its prediction (the step's FLOPs at the device's peak): on a GPU, "
        "bf16/fp16 run on tensor cores; on a CPU without AVX-512 BF16/AMX they are slower, "
        "and the table says so."),
    "02_kv_cache.ipynb": experiment_notebook(
        "kv_cache", "02 · KV cache: recompute against remember",
        "Greedy decoding with no cache (the whole prefix recomputed for every token) and with a "
        "dynamic cache (keys and values kept and grown each step). The tokens must be identical; "
        "you will see the throughput of each and the bytes the cache holds, measured from its "
        "tensors beside the formula.",
        "- `token_agreement` = 1: a cache changes the cost, never the answer.\n"
        "- `kv_bytes_per_token` = 2 (K and V) x layers x kv_heads x head_dim x bytes per element: "
        "for `tiny` in fp32, 2 x 4 x 2 x 64 x 4 = 4096 bytes. Grouped-query attention (2 kv heads "
        "for 4 query heads) halves it.\n"
        "- `flops`: without a cache the work grows with the square of the length; with it, "
        "linearly. The measured speed-up is far below the FLOP ratio on a small model: each "
        "decode step is bound by per-step overhead and by reading the weights, not by FLOPs."),
}

# Issue 3: training memory. Each entry: filename -> (experiment, title, intro, what to look for).
TRAINING_MEMORY = {
    "03_checkpointing.ipynb": ("checkpointing", "03 · Activation checkpointing", "TODO(checkpointing) intro", "TODO(checkpointing) look for"),
    "04_grad_accumulation.ipynb": ("grad_accumulation", "04 · Gradient accumulation", "TODO(grad_accumulation) intro", "TODO(grad_accumulation) look for"),
    "05_offload.ipynb": ("offload", "05 · CPU offload", "TODO(offload) intro", "TODO(offload) look for"),
    "06_memory_pool.ipynb": ("memory_pool", "06 · The CUDA caching allocator", "TODO(memory_pool) intro", "TODO(memory_pool) look for"),
    "07_batch_finder.ipynb": ("batch_finder", "07 · The OOM frontier", "TODO(batch_finder) intro", "TODO(batch_finder) look for"),
}
NOTEBOOKS.update({filename: experiment_notebook(*spec) for filename, spec in TRAINING_MEMORY.items()})
# TODO(planner): NOTEBOOKS["08_memory_planner.ipynb"] = planner_notebook()

if __name__ == "__main__":
    ROOT.mkdir(exist_ok=True)
    for filename, nb in NOTEBOOKS.items():
        nbformat.validate(nb)
        nbformat.write(nb, ROOT / filename)
        print("wrote", ROOT / filename)
