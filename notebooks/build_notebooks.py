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
sweep = {SWEEP}  # config fields and the values to sweep, e.g. {"batch_size": [1, 2, 4]}
interactive = True  # show the widget panel to re-run with other settings
runs_dir = None  # where results are stored (None: $LABKIT_RUNS_DIR or ./runs)'''


NPROC_PARAMETER = "\nnproc = None  # ranks: None is one per visible GPU, else {CPU_RANKS} CPU ranks"


def experiment_notebook(name: str, title: str, intro: str, look_for: str,
                        sweep: str = "{}", cpu_ranks: int | None = None,
                        extra: tuple = ()) -> nbformat.NotebookNode:
    """`cpu_ranks` (a multi-process experiment): adds the `nproc` parameter, and the run shows
    every rank's memory and step time. `extra`: cells shown after the measured numbers."""
    source = EXPERIMENT_PARAMETERS.replace("{SWEEP}", sweep)
    settings = '{**overrides, "device": device}'
    if cpu_ranks:
        source += NPROC_PARAMETER.replace("{CPU_RANKS}", str(cpu_ranks))
        settings = '{**overrides, "device": device, "nproc": nproc}'
    parameters = new_code_cell(source, metadata={"tags": ["parameters"]})
    return new_notebook(metadata=KERNEL, cells=[
        new_markdown_cell(f"# {title}\n\n{intro}"),
        parameters,
        new_markdown_cell("## The machine"),
        new_code_cell("from labkit import hardware\n\nprint(hardware.describe())"),
        new_markdown_cell("## Run: the reference first, then each variant checked against it, measured, timed"),
        new_code_cell(
            "from labkit.experiment import run_experiment\n"
            "from labkit.widgets import build_panel, show_result\n\n"
            f'result = run_experiment("{name}", preset=preset, overrides={settings},\n'
            '                        variants=None if variants == "all" else variants.split(","),\n'
            "                        sweep=sweep, runs_dir=runs_dir, progress=False)\n"
            "frame = result.frame()\n"
            f'show_result(frame, "{name}")'),
        new_markdown_cell("## Every measured number"),
        new_code_cell("from labkit import viz\n\nviz.readable(viz.metric_table(frame))  # numbers with units; "
                      "viz.metric_table(frame) holds them as numbers"),
        *extra,
        new_markdown_cell("## Your device against the H200 reference\n\nThe same experiment from "
                          "`labkit selfcheck` on an H200 (`data/reference/`), on the same axes: "
                          "memory should agree where the settings do, throughput should not."),
        new_code_cell("from labkit import views\n\n"
                      f'views.reference_overlay(frame, "{name}")'),
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
    new_code_cell("from labkit import viz\n\nviz.readable(pd.DataFrame(hardware.architecture()))"),
    new_markdown_cell("## Ceilings\n\nGPUs: datasheet peaks from `data/gpus.json` (dense, no sparsity). "
                      "CPU: the physical ceiling from its features (cores x FMA units x vector lanes x 2 "
                      "x clock, each term's source below), beside a short calibration: the best a plain "
                      "matmul reached here."),
    new_code_cell("from labkit.config import resolve_device\n\n"
                  "ceil = hardware.ceilings(resolve_device(device))\n"
                  "print(ceil.name, '|', ceil.source)\n"
                  "viz.readable(pd.DataFrame({'peak TFLOP/s': ceil.peak_tflops,\n"
                  "                           'calibrated TFLOP/s': ceil.calibrated_tflops}).assign(\n"
                  "    **{'bandwidth GB/s': ceil.bandwidth_gbps,\n"
                  "       'ridge FLOP/byte': lambda t: t['peak TFLOP/s'] * 1e12 / ((ceil.bandwidth_gbps or float('nan')) * 1e9)}))"),
    new_markdown_cell("## Environment knobs that change measurements"),
    new_code_cell("hardware.env_knobs() or 'none set'"),
    new_code_cell("import torch\n\nprint(torch.__config__.parallel_info())  # thread pools, OpenMP/MKL, their knobs"),
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
        "kv_cache", "02 · KV cache: recompute, grow, preallocate, page, quantize",
        "Greedy decoding with no cache (the whole prefix recomputed for every token, the "
        "reference) and with the keys and values kept: grown by concatenation (`dynamic`), "
        "preallocated to the longest length and written in place (`static`, as gpt-fast), in "
        "fixed-size blocks found through a block table (`paged`, as vLLM), or stored as int8 with a "
        "scale per token (`quantized`). Lossless caches must give the reference's tokens exactly; "
        "the quantized one keeps each layer's attention output within tolerance and reports its "
        "token agreement. You see the throughput, the bytes each layout allocates against those "
        "it uses (waste), and, with `preset = \"reference\"`, the perplexity delta on the model "
        "labkit trained itself (`labkit train-reference`), where quality numbers mean something.",
        "- `token_agreement` = 1 for every lossless cache: a cache changes the cost, never the "
        "answer.\n"
        "- `kv_bytes_per_token` = 2 (K and V) x layers x kv_heads x head_dim x bytes per element: "
        "for `tiny` in fp32, 2 x 4 x 2 x 64 x 4 = 4096 bytes; grouped-query attention (2 kv heads "
        "for 4 query heads) halves it.\n"
        "- `kv_waste_pct`: `static` allocates the whole context up front (93% unused for 16 + 128 "
        "tokens of a 2048 context); `paged` wastes at most one partly filled block per sequence "
        "(0.7% with 16-token blocks); `dynamic` none, but it copies the cache every step.\n"
        "- `quantized` against `static` with `kv_dtype=bfloat16` (the cell below): int8 plus a "
        "bf16 scale per token is 0.516x the bytes; on the reference model its attention output is "
        "within 0.5% of an exact cache's, all 128 tokens agree and the perplexity moves by "
        "+0.0006 (5.08 for the model on held-out text).\n"
        "- `achieved_gbps`: the weights read once per forward pass plus the cache held at each "
        "step, over the generation's time, against the device's bandwidth ceiling: decoding a "
        "small batch is bound by memory traffic and per-step overhead, not by FLOPs.",
        extra=(
            new_markdown_cell("## The paged cache's block tables (4 sequences): blocks are handed "
                              "out as the sequences grow, so a sequence's blocks are not contiguous"),
            new_code_cell("from labkit.config import resolve\n"
                          "from labkit.techniques import kv_cache\n\n"
                          'cfg = resolve(kv_cache.Config, preset, {**overrides, "device": device, "batch_size": 4},\n'
                          '              experiment="kv_cache")\n'
                          "viz.block_table_figure(kv_cache.paged_block_table(cfg)).show()"),
            new_markdown_cell("## int8 against bf16: the bytes and the attention error"),
            new_code_cell('bf16 = run_experiment("kv_cache", preset=preset, variants=["static", "quantized"],\n'
                          '                      overrides={**overrides, "device": device, "kv_dtype": "bfloat16"},\n'
                          "                      runs_dir=runs_dir, progress=False).frame()\n"
                          'viz.readable(viz.metric_table(bf16).loc[["kv_bytes", "kv_bytes_per_token",\n'
                          '                                         "attn_output_rel_error", "token_agreement"]])'),
        )),
    "16_batching.ipynb": experiment_notebook(
        "batching", "16 · Batching: static, dynamic, continuous and priority scheduling",
        "One workload of requests replayed in real time against the real model by five "
        "schedulers (the `tiny` preset serves `data/workloads/short.json`: 32 requests arriving "
        "as a Poisson process at 320 per second, prompts of 8 to 32 tokens, outputs of 4 to 80, a "
        "quarter of them high priority; the GPU presets serve `default.json`, 64 requests with "
        "outputs of 8 to 256): one request at a time (`sequential`, the reference), `static` "
        "batches that wait to fill and run until their longest output is done, `dynamic` batches "
        "per prompt-length bucket started when full or after a timeout, `continuous` batching "
        "that refills a slot as soon as its sequence ends (with the paged KV cache), and "
        "`priority`, which lets the urgent class go first and preempts low-priority work for it. "
        "The KV pool holds `kv_budget_tokens` positions: reserving schedulers must keep the "
        "longest possible sequence for every request, paging ones only what is used. Before "
        "anything is timed, each scheduler replays the workload with every continuation forced "
        "and must compute the reference's log-probability for every token.",
        "- `useful_tokens_per_s`: output tokens over the time to the last one. `continuous` "
        "against `static` is the point of iteration-level scheduling: static's batches wait "
        "for their longest output (so most rows sit finished) and for the batch to fill; "
        "`dynamic` buckets prompts, but the outputs make most of the padding, and its timeouts "
        "start partial batches. The predicted value is a bound: every decode step reading each "
        "weight once at the bandwidth; `decode_step_ms` against its bound and the replay's "
        "`decode_time_pct`, `prefill_time_pct`, `host_time_pct` and `idle_time_pct` say where "
        "the rest goes (on a CPU, mostly the fixed cost of each of a forward's few hundred "
        "operators).\n"
        "- `padding_waste_pct`: the positions computed for nobody: static pads prompts and "
        "carries finished rows, predicted exactly (its batches are consecutive groups in arrival "
        "order); continuous none.\n"
        "- `max_concurrent`: the budget caps a reserving scheduler at kv_budget_tokens // "
        "(longest prompt + longest output) rows (the predicted value); paging runs all "
        "`batch_size` and preempts (`preemptions`, `recomputed_pct`) when the pool runs dry.\n"
        "- `ttft_p99_high_ms` under `priority` against `continuous` (first come, first "
        "served): the urgent class no longer waits behind the queue; the low class pays with "
        "preemptions and a longer `tpot_p99_low_ms`.\n"
        "- `tpot`: larger batches cost each token a little more time; the Gantt charts show "
        "where the time goes.\n"
        "- `logprob_max_abs_diff` ~1e-6: batching, padding and preemption change only the order "
        "of floating-point sums.",
        extra=(
            new_markdown_cell("## Latency by priority class"),
            new_code_cell("viz.latency_bars(frame, \"ttft\").show()\n"
                          "viz.latency_bars(frame, \"tpot\").show()"),
            new_markdown_cell("## Who held which slot: static against continuous (one more replay "
                              "of each)"),
            new_code_cell("from labkit.config import resolve\n"
                          "from labkit.techniques import batching\n\n"
                          'for variant in ("static", "continuous"):\n'
                          '    cfg = resolve(batching.Config, preset, {**overrides, "device": device, '
                          '"variant": variant},\n'
                          '                  experiment="batching")\n'
                          "    viz.schedule_figure(*batching.schedule_frames(cfg), title=variant).show()"),
        )),
}

BATCH_FINDER_PARAMETERS = '''preset = None  # model shape and sizes: tiny, small, medium, gpt2-124m, ...; None: from the device
device = "auto"  # auto, cpu, cuda or cuda:N
variants = "all"  # comma-separated variants to run beside the reference, or "all"
seq_lens = [16, 32, 64]  # one search per sequence length: the frontier's x axis
cpu_budget_gib = 0.25  # the virtual memory budget on the CPU (a GPU searches its real memory)
overrides = {}  # any config field, e.g. {"mode": "dynamic", "effective_batch": 64}
interactive = True  # show the widget panel to re-run with other settings
runs_dir = None  # where results are stored (None: $LABKIT_RUNS_DIR or ./runs)'''


def batch_finder_notebook(name: str, title: str, intro: str, look_for: str) -> nbformat.NotebookNode:
    """The experiment notebook with a sweep over sequence lengths and the frontier figure."""
    return new_notebook(metadata=KERNEL, cells=[
        new_markdown_cell(f"# {title}\n\n{intro}"),
        new_code_cell(BATCH_FINDER_PARAMETERS, metadata={"tags": ["parameters"]}),
        new_markdown_cell("## The machine"),
        new_code_cell("from labkit import hardware\n\nprint(hardware.describe())"),
        new_markdown_cell("## Run: one search per sequence length and variant"),
        new_code_cell(
            "from labkit.experiment import run_experiment\n"
            f"from labkit.techniques.{name} import budget_overrides\n"
            "from labkit.widgets import build_panel\n\n"
            "settings = {**budget_overrides(device, cpu_budget_gib), **overrides, \"device\": device}\n"
            f'result = run_experiment("{name}", preset=preset, overrides=settings, sweep={{"seq_len": seq_lens}},\n'
            '                        variants=None if variants == "all" else variants.split(","),\n'
            "                        runs_dir=runs_dir, progress=False)\n"
            "frame = result.frame()"),
        new_markdown_cell("## The frontier"),
        new_code_cell("from labkit import viz\n\nviz.frontier(frame).show()"),
        new_markdown_cell("## Measured beside predicted, and what did not run"),
        new_code_cell("display(viz.readable(viz.predicted_table(frame)))\nviz.not_run(frame)"),
        new_markdown_cell("## Every measured number (averaged over the lengths)"),
        new_code_cell("viz.readable(viz.metric_table(frame))"),
        new_markdown_cell("## Try other settings\n\nOn a CPU, give the panel a `memory_budget_gib`: the "
                          "search needs a budget to run out of."),
        new_code_cell("if interactive:\n"
                      f'    display(build_panel("{name}", preset=preset, device=device, overrides=overrides,\n'
                      "                        runs_dir=runs_dir))"),
        new_markdown_cell(f"## What to look for\n\n{look_for}"),
    ])


# Issue 3: training memory. Each entry: filename -> (experiment, title, intro, what to look for).
TRAINING_MEMORY = {
    "03_checkpointing.ipynb": ("checkpointing", "03 · Activation checkpointing",
        "One training step with the blocks' activations kept for backward (`none`), or dropped "
        "and recomputed by `torch.utils.checkpoint` (non-reentrant): every block (`full`), every "
        "n-th (`every_n`), every block but keeping the matmul outputs (`selective`), or the blocks "
        "a memory budget needs (`budget`, chosen from a measured per-block table of bytes freed "
        "against time recomputed). Recomputation replays the same ops, so every gradient must "
        "equal `none`'s; then you see the bytes each keeps, the peak, the extra FLOPs and time.",
        "- `activation_bytes` (tiny preset, batch 4 x 64 tokens, fp32): `none` ~24.6 MiB; `full` "
        "~5.8 MiB (each block keeps only its (B, T, d) input; most of the rest is the loss's "
        "(B, T, vocab) log-probabilities); `every_n` and `selective` in between. The planner's "
        "figure is beside each.\n"
        "- `grad_max_abs_diff` = 0: bitwise equal gradients on a CPU.\n"
        "- `flops`: `full` adds one forward of each block less its MLP down-projection (the "
        "recomputation stops once the last tensor backward needs is rebuilt): +19% at tiny; "
        "`selective` adds 0 counted FLOPs (it replays only elementwise ops). Compare `step_ms` "
        "with `none`'s for the time it costs.\n"
        "- `peak_mem_bytes` falls by less than the activations: the optimizer step (weights, "
        "gradients, AdamW moments and their temporaries) sets a floor.\n"
        "- `budget`: set `overrides = {\"memory_budget_gib\": 0.085}` at tiny: `none` runs out "
        "of memory, `budget` checkpoints one block and fits; `num_checkpointed_blocks` says which "
        "and why. Without a budget on a CPU it checkpoints nothing; on a GPU it uses the free "
        "memory."),
    "04_grad_accumulation.ipynb": ("grad_accumulation", "04 · Gradient accumulation",
        "One optimizer step over k x b sequences: as one batch (`one_batch`), or as k micro-batches "
        "of b whose losses are scaled by 1/k and whose gradients sum in `.grad` (`accumulate`). "
        "`batch_size` is b, `micro_batches` is k. The gradients must match the large batch's "
        "within fp32 rounding; then you see that memory follows the micro-batch while every step "
        "still trains on k x b x T tokens.",
        "- `grad_max_rel_diff` (normwise, per parameter) ~3e-7: not 0, because k partial sums "
        "round differently from one sum, and far below the 1e-6 allowed.\n"
        "- `activation_bytes`: `accumulate` holds one micro-batch's (~24.6 MiB at tiny, b = 4), "
        "`one_batch` k times that.\n"
        "- `peak_mem_bytes`: `one_batch` grows with k; `accumulate` stays flat. Against a plain "
        "step of b (`micro_batches` = 1) it is higher by up to one gradient buffer (4 bytes per "
        "parameter, ~19 MiB at tiny): from the second micro-batch on, a full set of gradients sits "
        "beside one micro-batch's activations. The default sweep runs micro_batches 1 and 4.\n"
        "- `tokens_per_s`: the same tokens per step; k small forwards use the device less well than "
        "one large one (on a GPU more than on a CPU).", '{"micro_batches": [1, 4]}'),
    "05_offload.ipynb": ("offload", "05 · CPU offload",
        "Training with the tensors saved for backward (`save_on_cpu(pin_memory=True)`) and/or "
        "AdamW's state moved to host memory. Each variant trains the same weights on the same batch "
        "and must give the reference's losses and gradient norm; then you see the device memory it "
        "saves and the time its copies cost, against the host link's bandwidth measured here. On a "
        "CPU there is nothing to offload to: the variants are skipped with the reason and only the "
        "reference runs.",
        "- `peak_mem_bytes` (device memory): `activations` takes the activation term off the "
        "planner's peak, `optimizer` AdamW's 8 bytes per parameter, `both` both; "
        "`device_mem_saved_bytes` is the difference to the reference.\n"
        "- `transfer_bytes` per step and the measured pinned bandwidths `h2d_gbps`, `d2h_gbps`: "
        "`added_step_ms` is predicted as bytes each way / bandwidth (plus the host AdamW's memory "
        "traffic for `optimizer`) and measured as the check's last step against the reference's.\n"
        "- `loss_delta` and `grad_norm_delta` near 0: offloading moves bytes, it changes no number.\n"
        "- `device_optimizer_bytes` drops to 0 while `optimizer_bytes` grows to 12 bytes per "
        "parameter on the host (the moments plus the fp32 weights the host AdamW updates).\n"
        "- On a CPU: the reference's peak beside the planner's, and why the variants are skipped."),
    "06_memory_pool.ipynb": ("memory_pool", "06 · The CUDA caching allocator",
        "Decoding requests of varying lengths one after another, with the caching allocator as it "
        "comes (fixed-size segments), with `expandable_segments`, and with the KV cache in a buffer "
        "pool allocated once. The tokens must be identical; you see the bytes in live tensors "
        "(allocated) against what the allocator holds (reserved) against what the driver reports "
        "(NVML), and their difference, fragmentation. On a CPU there is no caching allocator: the "
        "variants are skipped with the reason and the reference runs.",
        "- `fragmentation_bytes` = reserved peak - allocated peak: the default allocator's grows as "
        "a concatenated KV cache and varying prompts free blocks the next, larger request cannot "
        "use; `expandable` keeps reserved near allocated.\n"
        "- `buffer_pool`: `kv_bytes` is the whole buffer from the start (2 x layers x kv_heads x "
        "head_dim x bytes x batch x (prompt_len + new_tokens)), but nothing is allocated per token.\n"
        "- `nvml_used_bytes` is above reserved by the CUDA context and by other processes.\n"
        "- `token_agreement` = 1: where memory comes from changes no number.\n"
        "- The setting is changed at run time (`torch._C._accelerator_setAllocatorSettings`, or "
        "`torch.cuda.memory._set_allocator_settings` in torch 2.6) and applies to segments made "
        "afterwards; for a whole process set `PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True` "
        "before CUDA initialises."),
    "07_batch_finder.ipynb": ("batch_finder", "07 · The OOM frontier",
        "The largest micro-batch that fits, for each combination of precision and activation "
        "checkpointing, found by probing: grow (doubling) until an OOM, then bisect. Each probe is "
        "a fresh model and optimizer running two training steps; after an OOM nothing of it stays "
        "alive. One search per sequence length draws the frontier, with the planner's answer "
        "beside it. On a CPU the search runs against a virtual memory budget (its tracker raises "
        "the same `torch.OutOfMemoryError` a GPU does); on a GPU against the real memory.",
        "- Below a line fits, above it runs out of memory. Once activations dominate, doubling the "
        "sequence length halves the batch; at short lengths the model states and the optimizer "
        "step's temporaries dominate and the line flattens.\n"
        "- Checkpointing (`_ckpt`) lifts the frontier: each block keeps only its input, for a "
        "second forward in backward (`step_ms`).\n"
        "- `max_batch_size` measured beside predicted (the planner's peak against the budget); "
        "`num_probes` about 2 log2(size) with `grow`, a few with `mode: dynamic`, which starts "
        "from the free memory.\n"
        "- With `effective_batch`, `accumulation_steps` = ceil(effective_batch / max_batch_size) "
        "keeps the sequences per optimizer step.\n"
        "- `peak_mem_bytes` at the size found sits just under the budget."),
}
NOTEBOOKS.update({filename: experiment_notebook(*spec) for filename, spec in TRAINING_MEMORY.items()})
NOTEBOOKS["07_batch_finder.ipynb"] = batch_finder_notebook(*TRAINING_MEMORY["07_batch_finder.ipynb"])


def planner_notebook() -> nbformat.NotebookNode:
    """The memory planner: the worked example, the terms of the recommended plan, a measured
    check of the planner on this machine, the panel. Every number comes from labkit.planner."""
    parameters = '''model = "llama-2-7b"  # the worked example's model: a preset (tiny, small, gpt2-124m, llama-2-7b, ...)
gpus = 4  # GPUs the worked example trains on (data parallel)
gpu_mem_gib = 24.0  # memory of each of those GPUs, GiB
seq_len = 4096  # tokens per sequence in the worked example
effective_batch = 32  # sequences per optimizer step in the worked example
check_overrides = {"batch_size": 4, "seq_len": 64}  # sizes of the tiny run measured here to check the planner
device = "auto"  # where that check runs: auto, cpu, cuda or cuda:N
interactive = True  # show the planner panel to try other inputs
runs_dir = None  # where the check's results are stored (None: $LABKIT_RUNS_DIR or ./runs)'''
    look_for = (
        "## What to look for\n\n"
        "- **fp32 → mixed precision** halves the activations, not the model states: mixed keeps "
        "2 + 2 + 12 = 16 bytes per parameter (16-bit weights and gradients; fp32 master weights, m "
        "and v), fp32's 4 + 4 + 8 again. Pure bf16 (8 bytes) halves them, at some cost in accuracy.\n"
        "- **Checkpointing** keeps each layer's input (full) or its matmul outputs (selective) "
        "instead of every intermediate; the peak then moves from the backward's start to the "
        "optimizer step, which holds every gradient and the optimizer's temporaries.\n"
        "- **ZeRO stages** divide by the data-parallel degree the optimizer states (1), then the "
        "gradients (2), then the parameters (3): (2 + 2 + K)Ψ → 4Ψ + KΨ/Nd → 2Ψ + (2 + K)Ψ/Nd → "
        "(2 + 2 + K)Ψ/Nd.\n"
        "- **Micro-batch and accumulation**: activations scale with the micro-batch; accumulating "
        "keeps the effective batch and holds the gradients through every backward.\n"
        "- **Measured vs predicted**: the planner's peak within a few percent of the measured one "
        "(the tests hold it to 10%), the activations to the byte.")
    return new_notebook(metadata=KERNEL, cells=[
        new_markdown_cell(
            "# 08 · The memory planner: what fits, and why\n\nBefore renting GPUs, predict what one "
            "training step holds on each: parameters, gradients and optimizer states per ZeRO stage, "
            "activations per layer with and without recomputation, the step's temporaries, and the "
            "KV cache for serving, each derived from the model's shapes (`labkit plan` on the "
            "command line gives the same answer)."),
        new_code_cell(parameters, metadata={"tags": ["parameters"]}),
        new_markdown_cell("## The machine"),
        new_code_cell("from labkit import hardware\n\nprint(hardware.describe())"),
        new_markdown_cell("## The worked example: a big model on a few small GPUs, one change per row "
                          "(the last row is the planner's recommendation)"),
        new_code_cell("from labkit import plan_view, viz\n\n"
                      "steps = plan_view.worked_example(model=model, gpus=gpus, gpu_mem_gib=gpu_mem_gib,\n"
                      "                                 seq_len=seq_len, effective_batch=effective_batch)\n"
                      "viz.readable(plan_view.worked_table(steps))"),
        new_code_cell('plan_view.stacked_terms(steps, title=f"{model}: predicted peak per GPU").show()'),
        new_markdown_cell("## The recommended plan, term by term, with the formula of each"),
        new_code_cell('print(plan_view.format_plan(steps["recommended"]))'),
        new_markdown_cell("## Is the planner right? One training step of the tiny model measured here "
                          "(the mixed-precision experiment's fp32 AdamW reference)"),
        new_code_cell("from labkit.experiment import run_experiment\n\n"
                      'check = run_experiment("mixed_precision", preset="tiny", variants=["fp32"],\n'
                      '                       overrides={**check_overrides, "device": device},\n'
                      "                       runs_dir=runs_dir, progress=False)\n"
                      "viz.readable(plan_view.measured_vs_predicted(check.frame()))"),
        new_markdown_cell("## Try other inputs"),
        new_code_cell("if interactive:\n"
                      "    display(plan_view.build_plan_panel(model=model, gpus=gpus, gpu_mem_gib=gpu_mem_gib,\n"
                      "                                       seq_len=seq_len, effective_batch=effective_batch))"),
        new_markdown_cell(look_for),
    ])


NOTEBOOKS["08_memory_planner.ipynb"] = planner_notebook()


def compare_notebook() -> nbformat.NotebookNode:
    """Across runs: stored runs side by side (any folder: yours or a colleague's), the cost per
    million tokens at a price the user enters, and the GPUs a model fits on. labkit.views holds
    the logic; every cell copes with an empty store."""
    parameters = '''runs_dir = None  # stored runs: yours, or a colleague's copied in; None: $LABKIT_RUNS_DIR or ./runs
price_per_gpu_hour = None  # what a GPU-hour costs you, e.g. 2.5; None: no cost (no price is assumed)
model = "llama-2-7b"  # the fit table's model: a preset (tiny, small, gpt2-124m, llama-2-7b, llama-3-70b, ...)
selfcheck = None  # your `labkit selfcheck --out` file, shown beside the H200 reference; None: the reference alone
interactive = True  # show the panels: pick runs, enter prices, try other fit settings'''
    look_for = (
        "## What to look for\n\n"
        "- **The overlay**: each run is one colour, labelled by the device it measured on (from its "
        "stored fingerprint) and its short id, so a GPU run and a CPU run of the same experiment "
        "share the memory and throughput axes. Memory should agree across machines for the same "
        "config (it is bytes of tensors); throughput should not.\n"
        "- **Cost** = price per hour x devices / 3600 / tokens_per_s x 1e6. On this 2-core CPU the "
        "`kv_cache` experiment's `dynamic` variant (tiny preset) measured 348 tokens/s against 106 "
        "without a cache: at any price per hour the cache makes each token 3.3x cheaper (each 1.00 "
        "per hour costs 0.80 per million tokens with it, 2.61 without). CPU rows are never priced "
        "by the GPU price: the note says so.\n"
        "- **Fit** (llama-2-7b, bf16, ZeRO-3, full checkpointing, micro-batch 1 x 2048, the "
        "planner's prediction): 62.76 GiB on one GPU, so one 80 GB GPU (17.24 GiB to spare); two "
        "40-48 GB GPUs (32.07 GiB each); four 24 GB GPUs (22.65 GiB, only 1.35 GiB to spare, "
        "before the CUDA context); sixteen 16 GB ones (15.59 GiB). ZeRO-3 divides the 8 bytes per "
        "parameter of model states by the GPU count; the activations of one micro-batch do not "
        "shrink, which is why 16 GB cards need so many.")
    return new_notebook(metadata=KERNEL, cells=[
        new_markdown_cell(
            "# 99 · Compare runs, price them, find the GPUs that fit\n\nEvery experiment stores its "
            "runs (one file each, with the machine's fingerprint). Here: the stored runs in a table; "
            "the latest runs of one experiment on the same memory and throughput axes (runs from "
            "other machines or people too: copy their run files into a folder and point `runs_dir` "
            "at it); the cost per million tokens of each measured configuration at the price you "
            "enter; and, from `data/gpus.json` and the memory planner, the fewest GPUs of each type "
            "a model and technique combination fits on."),
        new_code_cell(parameters, metadata={"tags": ["parameters"]}),
        new_markdown_cell("## The machine"),
        new_code_cell("from labkit import hardware\n\nprint(hardware.describe())"),
        new_markdown_cell("## Stored runs (newest first)"),
        new_code_cell("from labkit import views, viz\n"
                      "from labkit.results import load_results, runs_dir as store\n\n"
                      "frame = load_results(runs_dir)\n"
                      "runs = views.run_table(runs_dir)\n"
                      "if runs.empty:\n"
                      "    print(f'no runs stored yet in {store(runs_dir).resolve()}: run an experiment, '\n"
                      "          'or copy run files there')\n"
                      "else:\n"
                      "    display(runs.drop(columns='label'))"),
        new_markdown_cell("## The latest runs of one experiment, on the same axes"),
        new_code_cell("latest = views.latest_runs(frame, n=3)\n"
                      "if latest:\n"
                      "    name = runs.set_index('run_id').loc[latest[-1], 'experiment']\n"
                      "    views.compare_runs(frame, latest, title=f'{name}: the latest runs').show()\n"
                      "else:\n"
                      "    print('no measured runs to compare yet')"),
        new_markdown_cell("## Cost per million tokens of each measured configuration"),
        new_code_cell("cost = views.cost_table(frame, price_per_gpu_hour)\n"
                      "if cost.empty:\n"
                      "    print('no measured tokens_per_s rows yet: nothing to price')\n"
                      "else:\n"
                      "    display(viz.readable(cost.drop(columns='run_id')))"),
        new_markdown_cell("## Which GPUs, and how many, the model fits on (bf16, ZeRO-3, full "
                          "checkpointing; predicted by the planner)"),
        new_code_cell("fit = views.fit_table(model, precision='bf16', zero_stage=3, checkpointing='full')\n"
                      "views.fit_figure(fit, title=f'{model}: fewest GPUs that fit').show()\n"
                      "viz.readable(fit)"),
        new_markdown_cell("## Your device against the H200 reference\n\nWhat `labkit selfcheck` "
                          "measured on an H200 (`data/reference/h200.json`), check by check; with "
                          "your own `labkit selfcheck --out selfcheck.json` given as `selfcheck`, "
                          "yours beside it."),
        new_code_cell("import json\nfrom pathlib import Path\n\n"
                      "mine = json.loads(Path(selfcheck).read_text()) if selfcheck else None\n"
                      "viz.readable(views.selfcheck_table(mine), by_metric=('h200', 'yours'))"),
        new_markdown_cell("## Try other runs, prices and settings"),
        new_code_cell("if interactive:\n"
                      "    display(views.comparison_panel(runs_dir))\n"
                      "    display(views.cost_panel(frame))\n"
                      "    display(views.fit_panel(model))"),
        new_markdown_cell(look_for),
    ])


NOTEBOOKS["99_compare.ipynb"] = compare_notebook()


def leaderboard_notebook() -> nbformat.NotebookNode:
    """A workshop's runs side by side and the best per challenge, from a shared folder (or bundles
    imported into one), and the learning view of the room's exercise attempts. labkit.leaderboard
    holds the logic; every cell copes with an empty store."""
    parameters = '''runs_dir = None  # the room's shared folder (None: $LABKIT_RUNS_DIR or ./runs)
# metric: tokens_per_s, useful_tokens_per_s, requests_per_s, tflops, gbps, step_ms, peak_mem_bytes,
# bubble_fraction
metric = "tokens_per_s"  # what the side-by-side tables and the bars rank
preset = None  # only runs at this preset (tiny, small, medium, ...); None: every preset
by = "participant"  # the learning view: participant or team
interactive = True  # the live panel: choose the metric and grouping, Refresh as the room runs'''
    look_for = (
        "## What to look for\n\n"
        "- **Provenance**: every number names its run (`run_id`: the file in the shared folder), "
        "who ran it (participant, team: `LABKIT_PARTICIPANT`, `LABKIT_TEAM` or `--set "
        "participant=...`), the machine (from the run's stored fingerprint, not from what anyone "
        "typed), the date and the preset. A surprising number is checked by opening that run.\n"
        "- **Fair comparisons**: runs compete only at the same model shape (every model field, "
        "not just the preset name: one layer instead of four is less work, not a better "
        "technique), the same number of ranks (ZeRO's memory per rank falls as ranks are added) "
        "and dtype, on the same machine class (the GPU, or the CPU model; two laptops with the "
        "same CPU compete), and the memory challenges only at the same batch size and sequence "
        "length. The `group` names what was held fixed: the preset and only what differs "
        "from it.\n"
        "- **Machines differ more than techniques**: the same variant is many times faster on a "
        "GPU than on a laptop CPU. Compare techniques within one machine column, machines within "
        "one technique row; memory (bytes of tensors) should agree across machines.\n"
        "- **Unnamed runs** are shown as (unnamed): set your name before running.\n"
        "- **Learning**: `first_try_accuracy_pct` counts each person's first attempt at each "
        "exercise, what they knew before retrying; an exercise most of the room gets wrong is "
        "the one to go over together.")
    return new_notebook(metadata=KERNEL, cells=[
        new_markdown_cell(
            "# 98 · Workshop leaderboard\n\nEvery participant's stored runs, read from the room's "
            "shared folder: side by side by machine (GPU or CPU, from each run's fingerprint) and "
            "by technique (experiment/variant), the best configuration for each challenge, and "
            "each number's provenance. For machines that share no folder, import their bundles "
            "first: `labkit results import bundle.zip --runs-dir SHARED`. A facilitator's static "
            "copy: `labkit report --only 98_leaderboard --runs-dir SHARED`."),
        new_code_cell(parameters, metadata={"tags": ["parameters"]}),
        new_markdown_cell("## Who has run what"),
        new_code_cell("from labkit import leaderboard as lb\n"
                      "from labkit.results import runs_dir as store\n"
                      "from labkit.viz import readable\n\n"
                      "rows = lb.load_board(runs_dir, preset)\n"
                      "people, machines = sorted(set(rows['participant'])), rows['machine'].nunique()\n"
                      'print(f"{rows[\'run_id\'].nunique()} runs, {len(rows)} measurements by "\n'
                      "      f\"{len(people)} participants ({', '.join(people) or 'none yet'}) on \"\n"
                      '      f"{machines} machines, read from {store(runs_dir).resolve()}")'),
        new_markdown_cell("## The challenges and the best configuration for each\n\nOne row per "
                          "challenge and comparison group (`group`: the preset, the model fields "
                          "that differ from it, the settings held fixed, the ranks, the dtype and "
                          "the machine class); `entries`: the measurements that competed; `task`: "
                          "what to try."),
        new_code_cell("readable(lb.best_per_challenge(rows))"),
        new_markdown_cell("## Side by side by machine: each technique's best `metric` on each machine"),
        new_code_cell("readable(lb.side_by_side(rows, metric, by='machine'), metric=metric)"),
        new_markdown_cell("## Side by side by participant"),
        new_code_cell("readable(lb.side_by_side(rows, metric, by='participant'), metric=metric)"),
        new_markdown_cell("## Every participant's best, with its provenance"),
        new_code_cell("best = lb.entries(rows, metric)\n"
                      "if best.empty:\n"
                      "    print(f'no {metric} measured yet: run an experiment that measures it')\n"
                      "else:\n"
                      "    lb.figure(rows, metric).show()\n"
                      "readable(best, metric=metric)"),
        new_markdown_cell("## Learning: attempts and accuracy by topic and person\n\nEvery graded "
                          "exercise attempt stored in the runs folder's `attempts/`: per person (or "
                          "team, `by`) and topic, then over all topics and for the whole room."),
        new_code_cell("attempts = lb.load_learning(runs_dir)\n"
                      "if attempts.empty:\n"
                      "    print('no exercise attempts yet: answer one in notebooks/exercises/')\n"
                      "lb.learning_view(attempts, by)"),
        new_markdown_cell("## The exercises the room gets wrong most"),
        new_code_cell("lb.hardest_exercises(attempts)"),
        new_markdown_cell("## Live: refresh as the room runs (runs or learning)"),
        new_code_cell("if interactive:\n"
                      "    display(lb.leaderboard_panel(runs_dir, metric, preset))"),
        new_markdown_cell(look_for),
    ])


NOTEBOOKS["98_leaderboard.ipynb"] = leaderboard_notebook()

QUIZ_PARAMETERS = '''mode = "practice"  # practice (random draw), review (wrong answers first, then unseen), mock (timed exam)
topic = "all"  # all, memory, parallelism, distributed, profiling, inference, precision, operations (not in mock)
n = 10  # questions per quiz (mock: per exam)
minutes = None  # mock only: the time allowed (None: 2 minutes a question, the exam's pace)
seed = None  # a number: the same questions and choice order every time (a class sharing one quiz)
progress = None  # progress file (None: $LABKIT_QUIZ_PROGRESS or ~/.labkit/quiz_progress.json)
interactive = True  # the quiz widget; False: print the drawn questions with their answers (an answer key)'''

NOTEBOOKS["25_quiz.ipynb"] = new_notebook(metadata=KERNEL, cells=[
    new_markdown_cell("# 25 · Quiz: GPU acceleration and model optimization\n\n"
                      "**Scope.** This bank covers GPU acceleration and model optimization for LLMs: memory "
                      "and batch optimization, parallelism, multi-GPU setups, profiling and troubleshooting, "
                      "inference (KV cache, batching), mixed precision and kernels, GPU monitoring and "
                      "operations. That is the optimization part of the NVIDIA-Certified Professional: "
                      "Generative AI LLMs exam (NCP-GENL), **not the whole exam**: nothing here on prompting, "
                      "data preparation, evaluation or safety, and fine-tuning only for its memory (LoRA, QLoRA).\n\n"
                      "Pick a mode and a topic, answer, Submit: you see right or wrong, why your choice is "
                      "right or what misunderstanding it reflects, the explanation (with the formula) and "
                      "the notebook that measures it. Choices are shuffled at each draw (a shared `seed` "
                      "gives everyone the same order). `review` brings back what you last got wrong, then "
                      "what you have not seen. `mock` is a timed exam drawn by topic weight: no feedback "
                      "until the end, answers after the deadline do not count, a result per topic at the "
                      "end. The weights (`quiz.TOPIC_WEIGHTS`) are our topics' share of the exam's "
                      "optimization areas as one study guide reports the blueprint (GPU Acceleration and "
                      "Optimization 14%, Model Optimization 17%), split among our topics by us: they say "
                      "how a mock exam is drawn from this bank, not how the whole exam is weighted."),
    new_code_cell(QUIZ_PARAMETERS, metadata={"tags": ["parameters"]}),
    new_markdown_cell("## The question bank: is it fair?\n\nCounts by topic, how often the longest "
                      "choice is the answer (a test-wise learner's cue; ties split), and where the "
                      "answers land after one seeded shuffle (about 1/4 each for 4 choices)."),
    new_code_cell("from labkit import quiz\n\n"
                  "bank = quiz.load_bank()\n"
                  "print(quiz.format_stats(quiz.bank_stats(bank, seed=0)))\n"
                  'print("mock-exam weights:", quiz.TOPIC_WEIGHTS)'),
    new_markdown_cell("## The quiz"),
    new_code_cell("if interactive:\n"
                  "    display(quiz.quiz_panel(topic, n, seed=seed, progress=progress, mode=mode, minutes=minutes))\n"
                  "else:\n"
                  "    drawn = (quiz.mock_exam(n, minutes, seed, bank).questions if mode == \"mock\" else\n"
                  "             quiz.draw(topic, n, seed, bank, order=\"review\" if mode == \"review\" else \"random\",\n"
                  "                       progress=progress))\n"
                  "    for i, q in enumerate(drawn, 1):\n"
                  '        print(f"{i}. [{quiz.TOPICS[q.topic]}] {q.question}")\n'
                  "        for j, (choice, why) in enumerate(zip(q.choices, q.feedback)):\n"
                  "            print(f\"   {'*' if j == q.answer else ' '} {chr(65 + j)}. {choice}\\n        {why}\")\n"
                  '        print(f"   Why: {q.explanation}\\n   Measure it: {q.notebook}\\n")'),
    new_markdown_cell("## Your progress per topic"),
    new_code_cell("quiz.progress_summary(progress)"),
])

# Issue 4: multi-process experiments. Each entry: filename -> (experiment, title, intro, what to
# look for, default sweep, CPU ranks by default).
DISTRIBUTED = {
    "09_collectives.ipynb": ("collectives", "09 · Collectives: all-reduce, all-gather, reduce-scatter",
        "The three collectives every parallel training step is made of, run by every rank through "
        "torch.distributed (NCCL between GPUs, gloo between CPU ranks). Each is checked first: rank "
        "r contributes r + 1 everywhere and the result must equal the formula. Then each is timed "
        "across message sizes, the same number of times on every rank. Bandwidth is reported as "
        "nccl-tests does: `algbw_gbps` = S / t, and `busbw_gbps` = algbw x 2(n-1)/n for "
        "all-reduce, x (n-1)/n for the other two: the bytes each rank moves on its busiest link, "
        "comparable across collectives, world sizes and the link's own bandwidth.",
        "- `busbw_gbps` grows with the message: small messages pay latency per call, large ones "
        "approach the link. The prediction is the ceiling: the GPU's interconnect (NVLink 4 on "
        "H100/H200: 450 GB/s one way; PCIe Gen4 x16: 32) or, on CPU ranks, this CPU's copy "
        "bandwidth.\n"
        "- On this 2-core CPU gloo reaches 0.1-2 GB/s (loopback TCP, every byte copied several "
        "times) against a copy ceiling of ~13-30 GB/s: the gap is the transport, not the math.\n"
        "- An all-reduce is a reduce-scatter followed by an all-gather: at the same S its "
        "`step_ms` is about the sum of theirs; its bus factor 2(n-1)/n says the same.\n"
        "- `max_abs_error` = 0: integer-valued sums are exact in fp32.\n"
        "- On GPUs, `nccl_algo` (Ring, Tree), `nccl_proto` (LL, LL128, Simple) and `nccl_channels` "
        "can be swept: each point starts a new communicator with those settings, and the row notes "
        "record what was in force.",
        '{"message_bytes": [4096, 65536, 1048576, 16777216]}', 2),
    "10_data_parallel.ipynb": ("data_parallel", "10 · Data parallel: DDP, accumulation, compression",
        "n ranks each train on a slice of one global batch and DDP averages their gradients with "
        "all-reduces, bucket by bucket, while the backward is still running. The reference "
        "(`single`) is one process on the whole global batch: DDP must give its loss and "
        "gradients. Then: accumulation with an all-reduce after every micro-batch against "
        "`no_sync` (one all-reduce per step), and the gradient-synchronisation strategies of DDP's "
        "communication hooks: fp16 and bf16 compression and PowerSGD, with the bytes each hands "
        "to the all-reduce and what they cost in accuracy.",
        "- `grad_max_rel_diff` ~3e-7 for `ddp` and both accumulations: the mean of the ranks' mean "
        "gradients is the global batch's mean gradient, up to fp32 rounding.\n"
        "- `comm_bytes` per step and rank: the fp32 gradients (19.07 MiB at tiny) for `ddp`; k "
        "times that for `accumulate`; once for `accumulate_no_sync`; half with fp16/bf16 "
        "compression; ~0.1 MiB with rank-1 PowerSGD (P and Q instead of each matrix). A ring "
        "all-reduce moves 2(n-1)/n times that through each link.\n"
        "- The price of compression: `grad_max_rel_diff` ~1.6e-3 (fp16), ~2.8e-3 (bf16), ~1 for "
        "rank-1 PowerSGD's first step (error feedback repays it over later steps); `loss_delta` "
        "after a few steps says what it did to training.\n"
        "- `comm_fraction`: the share of the step the backward did not hide, measured as the "
        "synced backward against the same backward under `no_sync`, side by side. On gloo over "
        "loopback it is large; on NVLink, DDP's overlap hides most of it.\n"
        "- `num_buckets` follows `bucket_cap_mb`: sweep it (`sweep = {\"bucket_cap_mb\": [1, 4, 25]}`) "
        "to see more, smaller all-reduces start earlier in the backward.\n"
        "- `peak_mem_bytes`: DDP keeps its buckets, one more fp32 copy of the gradients, beside "
        "the planner's step.",
        "{}", 2),
    "11_zero.ipynb": ("zero", "11 · ZeRO and FSDP: sharding the model states",
        "Data parallelism in which each rank stops keeping every model state: plain DDP (`zero0`, "
        "the reference), the optimizer states sharded by `ZeroRedundancyOptimizer` (`zero1`), and "
        "FSDP2's `fully_shard` without (`zero2`) and with (`zero3`) resharding after forward; "
        "`zero3_offload` keeps the shards in host memory (GPUs only). Every variant trains the "
        "same weights on the same global batch and must end with DDP's weights and losses; then "
        "each rank's parameter, gradient and optimizer bytes are measured from its local tensors "
        "(a DTensor's local shard) at rest after the step, beside the ZeRO paper's formulas.",
        "- Per rank, on 2 ranks at the tiny preset (fp32 AdamW): `zero0` keeps 19.07 MiB of "
        "parameters, 19.07 of gradients and 38.14 of optimizer states; `zero1` halves the "
        "optimizer states (19.07: whole tensors balanced by size, so within a few percent of 1/2); "
        "`zero2` and `zero3` halve all three (9.54 / 9.54 / 19.07).\n"
        "- `zero2` keeps sharded parameters at rest too: FSDP2 reshards after the backward whatever "
        "`reshard_after_forward` says; it holds each block whole only from its forward to its "
        "backward (the paper's stage 2 keeps them whole always, and the row note says so).\n"
        "- `peak_mem_bytes`: 108.8 MiB for DDP (its gradient buckets live through the step), 89.8 "
        "for `zero1`, 69.2 for `zero3`, each beside the planner's stage figure.\n"
        "- `weight_max_rel_diff` = 0: averaging two ranks' gradients is exact, and AdamW is "
        "elementwise, so sharding its states changes no number.\n"
        "- `step_ms`: on CPU ranks gloo's all-gathers and reduce-scatters cost more than they save; "
        "on GPUs with NVLink the sharded stages run close to DDP's speed.",
        "{}", 2),
    "12_tensor_parallel.ipynb": ("tensor_parallel", "12 · Tensor parallel: Megatron's split with DTensor",
        "Every matrix split across the ranks, Megatron-style, with DTensor's `parallelize_module`: "
        "the query, key, value and MLP input projections by columns, the attention output and MLP "
        "down projections by rows (one all-reduce per block half), the embedding and the head by "
        "vocabulary. `tp_sp` adds sequence parallelism: the norms and the residual stream split "
        "along the sequence, each all-reduce becoming a reduce-scatter and an all-gather. The "
        "logits and every gradient (gathered whole) must equal the plain model's; then each "
        "rank's parameter bytes and the collectives of one step, counted by `CommDebugMode`, "
        "beside Megatron's formulas.",
        "- `param_bytes` per rank: 1/n of every split matrix, the norms whole: at tiny on 2 ranks "
        "10.00 MB against 20.00 MB, equal to `planner.stage_params(tp=2)`.\n"
        "- `logits_max_abs_diff` and `grad_max_rel_diff` ~1e-6: the split matmuls sum in another "
        "order.\n"
        "- Collectives per step (forward + backward): `tp` 4L + 2 all-reduces of b x s x h plus one "
        "all-gather of the logits (18 + 1 at 4 layers); `tp_sp` turns them into all-gather + "
        "reduce-scatter pairs and adds the norm weights' gradients. `comm_bytes` counts S per "
        "collective; `comm_bus_bytes` what a ring moves per rank: the same for both but for the "
        "norm gradients, while `tp_sp` stores 1/n of the norm and residual activations.\n"
        "- `step_ms`: on CPU ranks over loopback TCP the collectives cost more than the halved "
        "matmuls save, `tp_sp` (46 collectives a step) most; on NVLink inside one node, TP is how "
        "layers too large for one GPU run at all.",
        "{}", 2),
    "13_pipeline_parallel.ipynb": ("pipeline_parallel", "13 · Pipeline parallel: GPipe, 1F1B and the bubble",
        "The decoder cut into one stage per rank (`torch.distributed.pipelining`), each step fed "
        "m micro-batches. GPipe runs all m forwards, then all m backwards; 1F1B alternates once "
        "the pipe is full, so at most p micro-batches are in flight (it needs m >= p). The cut is "
        "measured: rank 0 times the embedding, a block and the head + loss, and the split that "
        "makes the slowest stage fastest wins (the vocabulary head weighs as much as a block). "
        "The loss and every gradient must equal the plain model's. Then the bubble, the idle "
        "share of each rank's step, is measured from timestamps of every forward and backward "
        "each stage computes. Its prediction is the schedule replayed on durations timed apart "
        "from the measured steps: each stage's forward and backward of one micro-batch, timed "
        "alone, and one activation's send and receive; the textbook (p-1)/(m+p-1) stands beside "
        "it as `ideal_bubble_fraction`.",
        "- `ideal_bubble_fraction` falls with m, as (p-1)/(m+p-1) says: 0.50, 0.33, 0.20, 0.11 "
        "for m = 1, 2, 4, 8 on 2 stages. It assumes equal stages and free sends.\n"
        "- `bubble_fraction`'s `predicted` is the GPipe or 1F1B schedule replayed on this run's "
        "`stage_fwd_ms`, `stage_bwd_ms` and `handoff_ms`: where it departs from the ideal, the "
        "stages' unequal compute and the handoffs are why. With the tiny defaults the cut is "
        "uneven (the vocabulary head weighs about as much as a block), so the lighter stage "
        "waits more and its bubble sits above the ideal, the other's below; `stage_cost_ms` and "
        "the notes show the cut and the measured costs.\n"
        "- Measured against predicted: what remains is what the calibration does not hold, the "
        "schedule's own host time between ops and a waiting rank's wake-ups, and other "
        "processes on the cores. `stall_fraction` is the share of a stage's compute its thread "
        "spent off the CPU; above a few percent the bubble measures a busy host, not the "
        "schedule.\n"
        "- `delay_stage` and `stage_delay_ms` make one stage sleep in every forward: its "
        "`stage_fwd_ms` grows by the sleep, the other stages' bubbles rise, and the replay "
        "predicts by how much, as it would for a slow GPU in a pipeline.\n"
        "- `loss_rel_diff` ~0 and `grad_max_rel_diff` ~1e-7: the mean of m micro-batch losses is "
        "the batch's loss, and m partial gradient sums equal one. `corrupt` shifts every "
        "activation, or scales every gradient, a stage sends by 0.1%: the check fails on every "
        "rank and the variant is an error row, untimed.\n"
        "- `param_bytes` per rank: its stage's parameters, equal to `planner.stage_params` for the "
        "chosen cut; 1F1B's peak holds fewer micro-batches' activations than GPipe's.",
        '{"micro_batches": [1, 2, 4, 8]}', 2),
    "14_hybrid.ipynb": ("hybrid", "14 · Hybrid parallel: a 2-D device mesh",
        "Four ranks laid out four ways: the plain model on each (`single`, the reference), 1-D "
        "FSDP over all four, 1-D tensor parallel over all four, and a 2 x 2 mesh (`fsdp_tp`): "
        "tensor parallel inside each pair of ranks, FSDP across the pairs, applied in torchtitan's "
        "order (TP, then FSDP, then the optimizer). Every layout must give the plain model's loss "
        "and gradients; then each rank's bytes and step time show what the second dimension "
        "buys.",
        "- `param_bytes` per rank: 1/4 of the model in every parallel layout (at tiny 5.26 MB "
        "against 21.05 MB), each equal to the planner's figure.\n"
        "- `peak_mem_bytes`: `fsdp_tp` below `fsdp` (34.7 against 45.0 MB at tiny): its "
        "all-gathers fetch TP shards, and the split matmuls keep 1/2 of the activations.\n"
        "- `step_ms`: on 4 CPU ranks sharing 2 cores every collective is expensive; `fsdp_tp` "
        "issues smaller all-gathers than `fsdp`. On a real cluster TP stays inside a node (NVLink) "
        "and FSDP spans the nodes.\n"
        "- The tiny preset runs this experiment with 4 kv heads, so 4-way TP can split them.",
        "{}", 4),
    "15_load_balance.ipynb": ("load_balance", "15 · Load balance across unequal devices",
        "Data parallelism waits for its slowest rank at every all-reduce. One rank is made slower "
        "(on the CPU it sleeps (slowdown - 1) x its compute time every step; on mixed GPUs, "
        "slowdown 1 lets the devices' own speeds show). The reference splits the global batch "
        "evenly; `proportional` splits it by each rank's measured speed, weighting each rank's "
        "loss by its share so the gradients stay the global batch's (checked).",
        "- `num_sequences` per rank: even 4 / 4; proportional gives the slow rank fewer (5 / 3 "
        "with slowdown 2 at tiny).\n"
        "- `wait_ms`: with the even split the fast rank waits at the all-reduce for most of the "
        "slow rank's extra time; proportional shrinks the wait.\n"
        "- `step_ms` per rank against the prediction max_i(share_i / speed_i) from the measured "
        "speeds: proportional below even (about 560 against 830-890 ms in one run here).\n"
        "- `grad_max_rel_diff` ~3e-7: weighting the losses by share keeps the global gradient.",
        "{}", 2),
}
NOTEBOOKS.update({filename: experiment_notebook(*spec) for filename, spec in DISTRIBUTED.items()})

KERNELS = {
    "17_attention.ipynb": experiment_notebook(
        "attention", "17 · Attention: naive, SDPA backends, sliding-window flex",
        "Causal self-attention (the preset's heads, kv heads and head_dim) on random q, k, v, forward "
        "and backward, written out (matmul, softmax, matmul) and through PyTorch's fused kernels. Each "
        "variant's output and q/k/v gradients are checked against the naive one before timing. You will "
        "see memory saved for backward grow quadratically (naive keeps the S x S probabilities) against "
        "linearly (fused kernels keep q, k, v, the output and a logsumexp per row), and the forward "
        "speed-up of a kernel that never writes the S x S matrix.",
        "- `activation_bytes` equals the formula to the byte: on the tiny preset at seq_len 1024 naive "
        "saves **76.00 MiB**, sdpa/flash **12.06 MiB** (6.3x); at 2048, 280 vs 24.1 MiB: naive grows 4x "
        "per doubling, fused 2x.\n"
        "- `fwd_ms` at 1024 on a 2-core CPU (one thread): naive 554-1312 ms, sdpa 100-118 ms "
        "(5.5-11x; the CPU default is the flash CPU kernel). `peak_mem_bytes` 229 vs 40 MiB.\n"
        "- `flops` are counted as FlopCounterMode counts them (the causal half not subtracted): fused "
        "backward recomputes q k^T, so fused shows 14 vs 12 B·H·S²·hd, yet runs faster; a causal kernel "
        "skips upper blocks, so its `tflops` can read above the peak.\n"
        "- On the CPU `efficient` and `cudnn` are skipped (no CPU kernel), and `flex_sliding` too "
        "(FlexAttention has no CPU backward); set `window` > 0 to see sliding-window attention on a GPU.",
        sweep='{"seq_len": [256, 512, 1024]}'),
    "18_compile.ipynb": experiment_notebook(
        "compile", "18 · torch.compile: cold compile, steady speed, break-even",
        "Eager PyTorch against `torch.compile` (mode `default`; on GPUs also "
        "`max-autotune-no-cudagraphs` and `reduce-overhead`). `target` is one transformer block "
        "(forward + backward) or one decode step of the whole model with a fixed-shape KV cache. "
        "Each compiled variant starts cold: its first call (the compile) is timed apart from the "
        "steady step, and compiled outputs and gradients are checked against eager before timing.",
        "- **Cold compile dwarfs the step**: on a 2-core CPU (tiny preset) the block compiled in "
        "58 s, the decode step in 35 s; the steps themselves take 5-50 ms.\n"
        "- **Decode gains, training barely**: decode 11.6 ms eager vs 5.5 ms compiled (x2, fusion "
        "removes per-op overhead of a small step); the block fwd+bwd 49 vs 48 ms, and slower in the "
        "interleaved probe: `break_even_steps` is never (matmul-bound, fusion saves little).\n"
        "- **Break-even**: `compile_s / (eager - compiled)`: ~17,000 decode steps here.\n"
        "- **Fixed shapes, no recompiles**: the decode step writes the cache at a position tensor "
        "and reads it whole under a mask: `num_recompiles` 0 over all decoded positions, "
        "`num_graph_breaks` 0, one graph.\n"
        "- **Same math**: `max_rel_diff` ~4e-7 in fp32; `flops` equal eager's (compiling fuses "
        "memory traffic, not arithmetic).",
        sweep='{"target": ["block", "decode"]}'),
    "19_fused_kernel.ipynb": experiment_notebook(
        "fused_kernel", "19 · Kernel fusion: residual add + RMSNorm, eager, compiled, Triton",
        "The step between two sublayers of a Llama block: add the sublayer's output to the residual "
        "stream, then RMSNorm the sum. Every op in it does a few FLOPs per element, so its time is "
        "memory traffic. Three ways to run it: the unfused eager ops (the reference: one kernel per "
        "op, each reading and writing the whole tensor), `torch.compile` of the same function "
        "(inductor fuses the chain; its cold compile is reported apart), and our own Triton kernel "
        "(`labkit/kernels/rmsnorm.py`: one row per program, fp32 inside, x, residual and weight read "
        "once, y and the new residual written once; CUDA only, skipped on the CPU with the reason). "
        "Each variant's outputs are compared with eager's before anything is timed.",
        "- `gbps`: the fused floor's bytes, (4 x rows x hidden + hidden) x bytes per element, over "
        "the measured time, beside the device's bandwidth ceiling (`peak_bandwidth_pct`). On one "
        "thread of a 2-core CPU (hidden 256, fp32): at 16384 rows eager reached 0.85 GB/s "
        "(78.5 ms) and compiled 8.5 GB/s (7.9 ms, 10x); at 4096 rows 2.5 against 8.2 GB/s "
        "(6.6 against 2.0 ms).\n"
        "- Above 100% of the ceiling: small tensors (256 rows: 1.3 MB) stay in the CPU's caches, "
        "faster than the memory the ceiling was measured on; there eager (0.11 ms) beats compiled "
        "(0.18 ms), whose per-call overhead (guards) is no longer hidden.\n"
        "- `compile_s`: the price of `compiled`, paid once per shape: 2.4-8.4 s here cold, 0.17 s "
        "when inductor's on-disk cache already holds the code.\n"
        "- `max_rel_error`: compiled and Triton round once where eager rounds twice; fp32 agrees to "
        "~1e-7, fp16 to ~7e-4.\n"
        "- On a GPU, `triton` against `compiled`: both are one fused kernel, so both should sit close "
        "to the bandwidth ceiling at large sizes; eager's unfused chain moves several times the bytes.",
        sweep='{"rows": [256, 4096, 16384]}'),
    "20_matmul.ipynb": experiment_notebook(
        "matmul", "20 · Matmul: dtypes, tensor cores, alignment and the roofline",
        "One C = A @ B in fp32 (the reference), TF32, fp16, bf16 and fp8 (per-tensor scales, "
        "`torch._scaled_mm`), each checked against fp32 within its dtype's tolerance, then timed. "
        "The `alignment` knob takes 1 (`off_by_one`) or 8 (`mult8`) off every dimension. The best "
        "`tflops` over sizes is this device's best measured rate, drawn below its roof (the "
        "datasheet on a GPU, the physical ceiling on a CPU): no point sits above its roof.",
        "- `flops` = 2mnk exactly; `gbps` is the least traffic ((mk + kn) inputs + mn outputs) over "
        "the step, so `tflops` / `gbps` is the intensity: 2n/3 x 1/4 FLOP per byte for fp32 "
        "squares (85 at 512), far right of the ridge: compute-bound.\n"
        "- `rel_error` against fp32: about 4e-4 for fp16, 3e-3 for bf16 (8-bit mantissa), a few "
        "percent for fp8.\n"
        "- On a GPU, fp16/bf16 on tensor cores run many times fp32 (989 against 67 TFLOP/s on an "
        "H100 datasheet). On a CPU it depends on the instructions: on the 2-core AVX-512 EPYC here "
        "bf16 (avx512_bf16) ran 0.22 TFLOP/s against fp32's 0.086-0.094, while fp16 (no "
        "avx512_fp16) ran 0.002: about 50x slower. On an AVX2 CPU bf16 is slow too; the "
        "`step_ms` note says which applies.\n"
        "- `off_by_one` (1023^3) ran at 0.067-0.069 TFLOP/s against 0.094 aligned here (0.72x); "
        "on GPUs unaligned shapes lose tensor-core tiles and vectorised loads.\n"
        "- tf32 and fp8 are skipped on a CPU with the reason; fp8 also when a dimension is not a "
        "multiple of 16.",
        sweep='{"alignment": ["aligned", "off_by_one"]}',
        extra=(
            new_markdown_cell("## The roofline: every experiment run so far on this device"),
            new_code_cell("from labkit import roofline\nfrom labkit.config import resolve_device\n\n"
                          "dev = hardware.ceilings(resolve_device(device)).device\n"
                          "ceil = roofline.ceilings_for(dev, runs_dir)\n"
                          "display(roofline.ceilings_table(ceil))\n"
                          "roofline.figure_for(dev, runs_dir).show()"),
        )),
    "21_memory_access.ipynb": experiment_notebook(
        "memory_access", "21 · Memory access: contiguous, strided, transposed, gathered",
        "The same float32 values copied (or summed by row) in different orders: in order (the "
        "reference), every `stride`-th element, through a transposed view, and at random indices. "
        "Memory moves whole lines (64 bytes on a CPU, 32-byte sectors on a GPU), so the cost is "
        "the lines touched, not the elements used. Every variant must reproduce the reference "
        "exactly; the contiguous copy at a size past the caches is the device's copy bandwidth, "
        "the roofline's slope.",
        "- `max_abs_diff` = 0 everywhere; `src_bytes` of `strided` is stride x the values (the "
        "buffer the view spans), `index_bytes` of `gather` 8 bytes per value.\n"
        "- Contiguous 64 MiB copy: 7-14 GB/s on this loaded 2-core CPU (read + write).\n"
        "- Strided over contiguous against the line model 2 / (min(stride, 16) + 1): measured 0.70, "
        "0.40, 0.21, 0.09 at stride 2, 4, 8, 16 against 0.67, 0.40, 0.22, 0.12; stride 32 fell to "
        "0.05 (adjacent-line prefetch and TLB misses, beyond the model).\n"
        "- `transposed` reached 2.6 GB/s against 6.8 contiguous here; `gather` 0.65 GB/s: one line "
        "per value.\n"
        "- `op=sum`: one add per 4 bytes: a point far left on the roofline, on the bandwidth slope.",
        sweep='{"stride": [2, 4, 8, 16]}'),
    "22_profiling.ipynb": experiment_notebook(
        "profiling", "22 · Profiling: where a training step's time goes, and what looking costs",
        "One training step of the model split into named phases (`data`, `forward`, `backward`, "
        "`optimizer`), each a `record_function` range and, on a GPU, an NVTX range. The plain step is "
        "the reference; `profiler` runs it under torch.profiler and `monitor` with a background device "
        "monitor (NVML on a GPU, process CPU % and memory on the CPU). Both must give the plain step's "
        "losses exactly. You see what each costs beside the plain step, the operator table, plain-words "
        "findings, the Chrome trace, the memory timeline by category, the monitor's timeline, and the "
        "commands that take the same run to Nsight Systems and Nsight Compute.",
        "- `profiler_overhead_pct`: torch.profiler (memory and shapes recorded) made the `tiny` step "
        "(batch 4 x 64 tokens, 125 ms plain) 40-70% slower on a 2-core CPU, measured back to back: it "
        "records each of ~7,000 op calls. Turning them into tables and writing the trace "
        "(`analysis_ms`) took another 0.5-1.5 s. Profile a few steps, never a whole run.\n"
        "- `top_op_share_pct`: `aten::mm` takes 49-52% of self CPU time: the matmuls are the step, as "
        "the FLOP count predicts.\n"
        "- `num_small_ops`: 83% of the leaf ops (1,625 of 1,969) take under 10 us: at this size "
        "per-op overhead, not math, sets their cost; on a GPU these are the launch-bound kernels that "
        "CUDA graphs and fusion remove.\n"
        "- `idle_gap_pct`: 2-6% of the timeline runs no operator on the CPU (Python between ops); on "
        "a GPU the same finding is the time no kernel runs.\n"
        "- `timeline_peak_bytes` = `peak_mem_bytes` (89.8 MiB): parameters 19.07 MiB and AdamW state "
        "38.14 MiB exactly as the planner says, plus 24.5 MiB of activations saved for backward.\n"
        "- `num_monitor_samples` against duration / interval: a Python sampling thread needs the GIL, "
        "so it falls behind while long ops hold it (483 of 527 expected on a quiet machine, 1,244 of "
        "1,917 on a busy one); `monitor_overhead_pct` is within noise (-1% to +3%).",
        extra=(
            new_markdown_cell("## One step profiled: findings, operator table, trace file"),
            new_code_cell("from labkit.config import resolve\n"
                          "from labkit.techniques import profiling\n\n"
                          'cfg = resolve(profiling.Config, preset, {**overrides, "device": device},\n'
                          '              experiment="profiling")\n'
                          "prof = profiling.profile_once(cfg)\n"
                          'print("\\n".join(prof.findings()))\n'
                          'print("Chrome trace (open in https://ui.perfetto.dev):", prof.trace_path)\n'
                          "viz.readable(prof.operators.head(12))"),
            new_markdown_cell("## The memory timeline: bytes live by category during the step"),
            new_code_cell("import plotly.express as px\n\n"
                          "mem = prof.memory.iloc[::max(1, len(prof.memory) // 300)]\n"
                          'px.area(mem.assign(time_ms=mem.time_us / 1e3), x="time_ms",\n'
                          '        y=[c for c in mem.columns if c != "time_us"], title=prof.memory_note).show()'),
            new_markdown_cell("## The device monitor over a few steps, phases marked"),
            new_code_cell("monitor = profiling.monitor_once(cfg, steps=3)\n"
                          "print(monitor.source, monitor.note)\n"
                          "monitor.figure().show()"),
            new_markdown_cell("## On a GPU machine: the same run in Nsight Systems and Nsight Compute"),
            new_code_cell("from labkit.measure import profiler\n\n"
                          "print(profiler.nsys_command(preset=preset))\n"
                          'print(profiler.ncu_command("gemm", launch_skip=4, nvtx_range="forward", preset=preset))'),
        )),
    "23_dataloading.ipynb": experiment_notebook(
        "dataloading", "23 · Data loading: pinned memory, non_blocking copies, worker processes",
        "A training loop fed by `torch.utils.data.DataLoader`. Every step waits for the next batch, "
        "copies it to the device and trains on it. Each sample is seeded by its index and costs "
        "`sample_cost_us` of real CPU work (hashing, not sleep); `io_latency_us` adds a sleep that "
        "models waiting on storage. Variants: no workers and pageable memory (`baseline`), "
        "`pinned` host memory, `non_blocking` copies, `workers` processes with `prefetch_factor` "
        "batches in flight, and `workers_pinned`. Every variant trains on the same batches in the "
        "same order and must give the reference's losses exactly. You see the step time, the share "
        "of it spent waiting for data (`data_wait_pct`), the compute time, the time to the first "
        "batch (worker startup), and on GPUs the host-to-device `h2d_gbps`.",
        "- `loss_delta` = 0 and `batches_match` = 1 everywhere: loading changes the time, never the "
        "batches.\n"
        "- Without workers the step is data + compute: with 20 ms of hashing per sample (80 ms a "
        "batch) beside about 105 ms of compute, `data_wait_pct` was 42-45 % on a 2-core CPU.\n"
        "- With 2 workers the wait fell to 2.4-3.2 %, but the step did not get faster (about "
        "185 ms): on 2 cores the workers take CPU time from the training thread, and "
        "`compute_ms` rose from about 105 to about 180 ms. max(compute, data / workers) assumes a "
        "free core per worker.\n"
        "- Set `sample_cost_us=0, io_latency_us=20000` (waiting, not working): workers hide it "
        "completely, 300 ms down to 106 ms a step.\n"
        "- `first_batch_ms` is worker startup: about 1.3-2 s the first time (the forkserver "
        "imports torch once), then tens to a few hundred ms; `persistent_workers` keeps workers "
        "across epochs. `start_method=spawn` imports torch again in every worker.\n"
        "- On a CPU, `pinned` and `non_blocking` change nothing (there is no copy to the device), "
        "and the note says so. On a GPU, compare `h2d_gbps` pageable vs pinned. A token batch is "
        "tiny (B x (T+1) x 8 bytes), so the copy is latency-bound."),
    "24_threads.ipynb": experiment_notebook(
        "threads", "24 · Threads: set_num_threads, OMP_NUM_THREADS, MKL_NUM_THREADS, inter-op",
        "The same CPU work (a matmul, a memory-bound elementwise add, or the model's forward: `work`) "
        "on one intra-op thread (the reference) and on `threads` threads, set four ways: "
        "`torch.set_num_threads` in this process, `OMP_NUM_THREADS` or `MKL_NUM_THREADS` in a fresh "
        "process (they are read once, at start), and `torch.set_num_interop_threads` in a fresh process "
        "(it can be set once). Each variant reports the thread count torch had while the work ran "
        "(the proof the knob took effect), its output against the reference, and its speed-up over "
        "the same work on one thread timed in the same process. Fresh processes run with "
        "`CUDA_VISIBLE_DEVICES=\"\"`; on a GPU machine a row shows they saw no GPU. Run it with "
        "`device = \"cpu\"`: the work is on the CPU.",
        "- `num_threads_seen`: 1, n, n, n, 1 (interop keeps one intra-op thread; its "
        "`interop_threads_seen` is n). `MKL_NUM_THREADS` alone sets every operator's count: torch "
        "reads it, and it wins over `OMP_NUM_THREADS`.\n"
        "- `speedup` against min(n, physical cores) for `matmul` and `forward`. On this 2-core shared "
        "CPU (load average 2-3.5 from other jobs) two threads were *slower*: 1024^3 matmul 21-23 ms on "
        "one thread, 32-44 ms on two (speed-up 0.64-0.67, so Amdahl's `serial_fraction` > 1 means "
        "waiting, not serial work); the tiny forward 28-41 ms vs 135-750 ms. That is the OpenMP barrier "
        "stall of a descheduled vCPU (see the IQR), and why the lab times on one thread.\n"
        "- `elementwise` (64 MiB x + y -> out): 26-33 GB/s on one thread; two threads gave 0.75-0.95x "
        "(predicted from the copy bandwidth measured at 1 and n threads, 0.5x here): once one core "
        "saturates memory, more threads cannot help.\n"
        "- `interop`: speed-up 0.85-0.99, predicted 1: the inter-op pool runs `torch.jit.fork` "
        "tasks, never eager operators.\n"
        "- On a many-core machine set `threads` to the physical core count: the matmul speed-up "
        "should approach it, the elementwise one flatten once memory bandwidth is reached.",
        extra=(new_markdown_cell("## Thread knobs set in this environment"),
               new_code_cell("from labkit.techniques import threads\n\nprint(threads.env_note())"))),
}
NOTEBOOKS.update(KERNELS)

if __name__ == "__main__":
    ROOT.mkdir(exist_ok=True)
    for filename, nb in NOTEBOOKS.items():
        for i, cell in enumerate(nb.cells):
            cell.id = f"cell-{i:02d}"  # stable ids: a rebuild changes only what was edited
        nbformat.validate(nb)
        nbformat.write(nb, ROOT / filename)
        print("wrote", ROOT / filename)
