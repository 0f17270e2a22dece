"""The CUDA paths of the measurement layer, on a real GPU: the memory meter's counts of a known
allocation and its OOM path under a virtual budget (down to the harness's `oom` row), CUDA-event
timing, and the FLOPs of the fused SDPA kernels; and the GPU side of tests that other files pin to
the CPU: weight-only quantization (fp8, the loaders' peaks), NVML energy, NCCL settings. Skipped,
with the reason, without a GPU."""
import dataclasses
import math

import pytest
import torch

from conftest import TINY_TRAIN, FAST, measured
from labkit import planner
from labkit.config import MODELS, resolve
from labkit.harness.experiment import run_experiment
from labkit.measure import timer
from labkit.measure.flops import make_flop_counter
from labkit.measure.memory import MemoryMeter
from labkit.techniques import attention

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA GPU: the caching allocator's counters, CUDA events and the fused "
           "attention kernels exist only there (the CPU paths are tested in test_measure.py)")

MIB = 2**20


def test_meter_counts_a_known_allocation_exactly_on_cuda():
    """Sizes that are whole multiples of the allocator's 512-byte blocks: counted as requested."""
    with MemoryMeter("cuda") as meter:
        a = torch.empty(MIB // 4, device="cuda")  # 1 MiB of fp32
        b = torch.empty(3 * MIB, dtype=torch.uint8, device="cuda")
        assert meter.current_bytes == 4 * MIB and meter.peak_bytes == 4 * MIB
        del a
        assert meter.current_bytes == 3 * MIB and meter.peak_bytes == 4 * MIB
        meter.reset_peak()
        c = torch.ones(2 * MIB, dtype=torch.uint8, device="cuda")
        assert meter.peak_bytes == 5 * MIB
        assert meter.reserved_bytes >= 5 * MIB  # the allocator's segments hold what is allocated
        used = meter.nvml_used_bytes  # None without NVML
        assert used is None or used >= 5 * MIB
        del b, c
        assert meter.current_bytes == 0


def test_a_budget_caps_the_cuda_allocator_with_an_out_of_memory_error_then_lifts():
    held = []
    with pytest.raises(torch.OutOfMemoryError):
        with MemoryMeter("cuda", budget_bytes=64 * MIB):
            held.append(torch.empty(32 * MIB, dtype=torch.uint8, device="cuda"))  # within it
            held.append(torch.empty(128 * MIB, dtype=torch.uint8, device="cuda"))  # past it
    assert len(held) == 1
    held.clear()
    after = torch.empty(128 * MIB, dtype=torch.uint8, device="cuda")  # the cap is gone again
    assert after.nbytes == 128 * MIB


def test_out_of_memory_on_cuda_is_an_oom_row_and_the_sweep_goes_on():
    budget_gib, small, large = 0.5, 2, 4096
    m = dataclasses.replace(MODELS["tiny"], num_layers=TINY_TRAIN["num_layers"])
    plan = {b: planner.training_memory(m, batch_size=b, seq_len=TINY_TRAIN["seq_len"],
                                       device="cuda").total_bytes for b in (small, large)}
    # the premise, from the planner: the small batch fits with room to spare, the large does not
    budget = budget_gib * 2**30
    assert plan[small] < budget / 4 and plan[large] > 4 * budget
    rows = run_experiment("mixed_precision", preset="tiny", variants=["fp32"], progress=False,
                          overrides={**TINY_TRAIN, "device": "cuda", "memory_budget_gib": budget_gib},
                          sweep={"batch_size": [small, large, 1]}).rows
    statuses = {r["params"]["sweep"]["batch_size"]: r["status"] for r in rows}
    assert statuses == {small: "ok", large: "oom", 1: "ok"}
    oom = [r for r in rows if r["status"] == "oom"]
    assert len(oom) == 1 and "out of memory" in oom[0]["message"].lower()
    peak = [r for r in rows if r["metric"] == "peak_mem_bytes"]
    assert len(peak) == 2 and all(0 < r["value"] <= budget for r in peak)


def test_cuda_event_timing_measures_device_time_and_the_repeats_it_says(monkeypatch):
    cycles = 10**7  # spun on the GPU: >= 1 ms at any clock up to 10 GHz; the launch returns at once
    step = lambda: torch.cuda._sleep(cycles)  # noqa: E731
    timing = timer.time_step(step, device="cuda", warmup=1, min_run_time_s=0.0, min_repeats=5)
    assert len(timing.times_s) == 5 and timing.warmup == 1
    assert min(timing.times_s) >= 1e-3 and timing.median_s >= 1e-3  # device time, not launch time
    calls, real = [], timer._cuda_events

    def spy(fn, repeats):
        calls.append((repeats, real(fn, repeats)))
        return calls[-1][1]

    monkeypatch.setattr(timer, "_cuda_events", spy)
    timing = timer.time_step(step, device="cuda", warmup=0, min_run_time_s=0.02, min_repeats=2)
    (one, first), (repeats, times) = calls  # a first timed call sizes the run
    assert one == 1 and repeats == max(2, math.ceil(0.02 / first[0])) and timing.times_s == times


FUSED = {"flash": "_scaled_dot_product_flash_attention",
         "efficient": "_scaled_dot_product_efficient_attention",
         "cudnn": "_scaled_dot_product_cudnn_attention"}


def attention_cfg(variant: str, kv_heads: int):
    overrides = {**FAST, "device": "cuda", "dtype": "float16", "variant": variant, "batch_size": 2,
                 "seq_len": 128, "hidden_size": 256, "num_heads": 4, "num_kv_heads": kv_heads}
    return resolve(attention.Config, "tiny", overrides, experiment="attention")


def counted(fn) -> tuple[int, set[str]]:
    """FLOPs of one call of `fn` and the names of the ops they were counted on."""
    with make_flop_counter() as counter:
        fn()
    names = {str(op).removeprefix("aten.") for op in counter.get_flop_counts().get("Global", {})}
    return counter.get_total_flops(), names


@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("variant", list(FUSED))
def test_fused_sdpa_kernels_count_the_math_formula(variant, kv_heads):
    """4·B·H·T·S·D forward (q k^T and p v; the causal half not subtracted), 10 more backward (q k^T
    recomputed), counted on the forced kernel itself: GQA's k, v counted at the query's heads."""
    cfg = attention_cfg(variant, kv_heads)
    reason = attention.skip_reason(cfg)
    if reason:
        pytest.skip(reason)
    attend, (q, k, v, grad_out) = attention.make_attention(cfg), attention.make_inputs(cfg)
    b, h, t, d = q.shape
    unit = b * h * t * k.shape[2] * d
    flops, ops = counted(lambda: attend(q, k, v))
    assert flops == 4 * unit == attention.attention_flops(cfg)["forward"] and ops == {FUSED[variant]}
    flops, ops = counted(lambda: attend(q, k, v).backward(grad_out))
    assert flops == 14 * unit == attention.attention_flops(cfg)["step"]
    assert ops == {FUSED[variant], FUSED[variant] + "_backward"}


def test_the_harness_counts_the_fused_kernels_flops_on_cuda(monkeypatch):
    # FLOPs are the point here, not fp16 accuracy against naive (test_attention.py checks that)
    monkeypatch.setitem(attention.TOLERANCE, "float16", 1.0)
    overrides = {**FAST, "device": "cuda", "dtype": "float16", "batch_size": 2, "seq_len": 128,
                 "hidden_size": 256, "num_heads": 4, "num_kv_heads": 2}
    rows = run_experiment("attention", preset="tiny", variants=["naive", *FUSED], progress=False,
                          overrides=overrides).rows
    assert all(r["status"] in ("ok", "skipped") for r in rows), [r for r in rows if r["status"] != "ok"]
    ran = {r["variant"] for r in rows if r["status"] == "ok"}
    assert "naive" in ran
    for variant in ran:
        row = [r for r in rows if r["variant"] == variant and r["metric"] == "flops"]
        assert len(row) == 1 and row[0]["value"] == row[0]["predicted"]


# --- the GPU side of tests pinned to the CPU elsewhere (test_weight_quant.py, test_energy.py,
# test_distributed.py): what the same code does where the default device is cuda

QUANT_SIZES = {**FAST, "prompt_len": 4, "new_tokens": 4, "num_layers": 2, "device": "cuda"}


def test_weight_quant_on_cuda_stores_the_formulas_bytes_and_runs_fp8_where_it_can():
    from labkit.techniques import weight_quant

    rows = measured(run_experiment("weight_quant", preset="tiny", overrides=QUANT_SIZES,
                                   progress=False).rows)  # energy: skipped where NVML cannot read it
    fp8_ok = torch.cuda.get_device_capability() >= (8, 9)
    for variant in weight_quant.VARIANTS:
        status = {r["status"] for r in rows if r["variant"] == variant}
        if variant == "fp8" and not fp8_ok:
            assert status == {"skipped"}
            continue
        assert status == {"ok"}, [r["message"] for r in rows if r["variant"] == variant]
        (stored,) = [r for r in rows if r["variant"] == variant and r["metric"] == "weight_bytes"]
        assert stored["value"] == stored["predicted"]  # scales and zero points included


def test_quantize_on_load_peaks_lower_than_load_then_quantize_on_the_cuda_allocator():
    from labkit.techniques import weight_quant

    cfg = resolve(weight_quant.Config, "tiny", {**QUANT_SIZES, "variant": "int4"},
                  experiment="weight_quant")
    peaks = {p["loading"]: p for p in weight_quant.loading_peaks(cfg)}
    for p in peaks.values():  # the quantizer's temporaries come on top of the prediction
        assert p["measured_peak_bytes"] >= p["predicted_peak_bytes"], p
    assert (peaks["quantize_on_load"]["measured_peak_bytes"]
            < peaks["load_then_quantize"]["measured_peak_bytes"])


def test_energy_per_token_on_cuda_is_read_from_nvml_under_the_board_power_bound():
    from labkit.measure import energy

    rows = run_experiment("kv_cache", preset="tiny", variants=["static"], progress=False,
                          overrides={**FAST, "prompt_len": 4, "new_tokens": 6, "num_layers": 2,
                                     "batch_size": 2, "device": "cuda",
                                     "min_run_time_s": 1.0}).rows  # NVML's counter is coarse
    tdp = energy.gpu_tdp_watts("cuda")  # None for a GPU not in data/gpus.json
    for variant in ("none", "static"):
        (jpt,) = [r for r in rows if r["variant"] == variant and r["metric"] == "joules_per_token"]
        if jpt["status"] == "skipped":
            pytest.skip(f"NVML's energy counter is not readable here: {jpt['message']}")
        assert jpt["status"] == "ok" and jpt["unit"] == "J/token" and jpt["value"] > 0
        # the datasheet's board power over the whole window, per token: an upper bound
        assert (jpt["predicted"] is not None) == (tdp is not None)
        assert tdp is None or jpt["value"] <= jpt["predicted"], jpt
        (idle,) = [r for r in rows if r["variant"] == variant and r["metric"] == "idle_watts"]
        assert idle["value"] > 0  # a GPU draws power doing nothing


def test_nccl_settings_are_accepted_for_gpu_ranks():
    from labkit.techniques import collectives

    cfg = resolve(collectives.Config, "tiny",
                  {"device": "cuda", "nccl_algo": "Ring", "nccl_channels": "4"})
    collectives.validate(cfg)  # refused on CPU ranks (test_distributed.py), accepted here
    assert collectives.nccl_env(cfg) == {"NCCL_ALGO": "Ring", "NCCL_MIN_NCHANNELS": "4",
                                         "NCCL_MAX_NCHANNELS": "4"}
