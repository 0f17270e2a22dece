import dataclasses
import gc
import sys
import time

import pytest
import torch

from labkit import planner
from labkit.config import MODELS
from labkit.measure.flops import count_flops
from labkit.measure.memory import (LiveTensorTracker, MemoryMeter, SavedTensorMeter,
                                   storage_bytes)
from labkit.measure.roofline import roofline
from labkit.measure.timer import Timing, time_step
from labkit.blocks.model import build_model
from labkit.techniques import kv_cache

MIB = 2**20


@pytest.mark.slow
def test_timer_runs_warmup_then_at_least_the_repeats_and_measures_the_step():
    calls = []

    def step():
        calls.append(1)
        time.sleep(0.02)

    timing = time_step(step, warmup=2, min_run_time_s=0.0, min_repeats=4)
    # no minimum time: exactly the warm-up calls and the repeats, no untimed block-size estimate
    assert len(timing.times_s) == 4 and len(calls) == 2 + 4
    # sleep() can only overshoot: every repeat is at least the 20 ms slept
    assert min(timing.times_s) >= 0.02 and timing.median_s >= 0.02
    assert timing.iqr_s >= 0.0


def test_timer_keeps_timing_until_the_minimum_time():
    """Read off the clock around it, not off a count of 10 ms sleeps: on a throttled CPU a 10 ms
    sleep takes longer (under a 0.4-core quota three calls filled the 0.1 s)."""
    start = time.perf_counter()
    timing = time_step(lambda: time.sleep(0.01), warmup=0, min_run_time_s=0.1, min_repeats=1)
    assert time.perf_counter() - start >= 0.1 and len(timing.times_s) >= 1


def test_timing_statistics():
    t = Timing(times_s=(1.0, 2.0, 3.0, 4.0, 100.0), warmup=0)
    assert t.median_s == 3.0 and t.iqr_s == 2.0 and t.median_ms == 3000.0


def test_meter_counts_a_known_allocation_exactly_and_sees_it_freed():
    with MemoryMeter("cpu") as meter:
        a = torch.empty(MIB // 4)  # 1 MiB of fp32
        view = a[10:]  # a view allocates nothing
        b = torch.empty(3 * MIB, dtype=torch.uint8)
        assert meter.current_bytes == 4 * MIB and meter.peak_bytes == 4 * MIB
        del a, view
        assert meter.current_bytes == 3 * MIB
        meter.reset_peak()
        c = torch.ones(2 * MIB, dtype=torch.uint8)
        del b, c
        assert meter.current_bytes == 0 and meter.peak_bytes == 5 * MIB


def test_meter_sees_the_temporaries_of_an_op_chain():
    x = torch.randn(256, 256)  # 256 KiB, made outside: not counted
    with MemoryMeter("cpu") as meter:
        y = (x * 2 + 1).sum()  # two 256 KiB temporaries alive at once at most
        del y
    assert meter.peak_bytes == 2 * 256 * 256 * 4
    assert meter.current_bytes == 0


def test_virtual_budget_raises_out_of_memory_and_memory_returns():
    tracker = LiveTensorTracker(budget_bytes=2 * MIB)
    with pytest.raises(torch.OutOfMemoryError, match="virtual memory budget"):
        with tracker:
            keep = [torch.empty(MIB // 4) for _ in range(3)]  # noqa: F841 (held: the third MiB crosses 2 MiB)
    gc.collect()
    assert tracker.current_bytes == 0


def test_storage_bytes_counts_each_storage_once():
    a = torch.zeros(100)
    tied = torch.nn.Linear(10, 10, bias=False)
    assert storage_bytes([a, a[:10], a.view(10, 10)]) == 400
    assert storage_bytes([tied.weight, tied.weight]) == 400
    assert storage_bytes([torch.zeros(10, dtype=torch.bfloat16)]) == 20
    assert storage_bytes([torch.empty(5, device="meta")]) == 0


def test_saved_tensor_meter_counts_what_backward_keeps():
    w = torch.nn.Parameter(torch.randn(64, 32))
    x = torch.randn(8, 64, requires_grad=True)
    with SavedTensorMeter(exclude=[w]) as saved:
        h = x @ w  # saves x (the parameter w is excluded)
        y = torch.tanh(h)  # saves its output
        y.sum().backward()
    assert saved.total_bytes == 8 * 64 * 4 + 8 * 32 * 4
    assert saved.by_dtype == {"float32": 8 * 64 * 4 + 8 * 32 * 4}
    assert saved.weight_copy_bytes == 0


def test_saved_tensor_meter_puts_autocast_weight_casts_apart():
    lin = torch.nn.Linear(64, 32, bias=False)
    x = torch.randn(8, 64, requires_grad=True)
    with SavedTensorMeter(exclude=lin.parameters()) as saved:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            lin(x)
    assert saved.weight_copy_bytes == 64 * 32 * 2  # the bf16 copy of the weight
    assert saved.by_dtype == {"bfloat16": 8 * 64 * 2}  # the bf16 copy of the input


def test_flop_counter_counts_matmuls_and_cpu_attention():
    a, b = torch.randn(8, 16), torch.randn(16, 4)
    assert count_flops(lambda: a @ b) == 2 * 8 * 16 * 4
    q = torch.randn(2, 3, 10, 8)
    flops = count_flops(lambda: torch.nn.functional.scaled_dot_product_attention(q, q, q))
    assert flops == 2 * 3 * 4 * 10 * 10 * 8  # QK^T and PV: 2 matmuls of 2*T*T*D per head


@pytest.mark.parametrize("attention", ["sdpa", "naive"])
def test_planner_predicts_the_counted_train_step_flops_exactly(attention):
    m = dataclasses.replace(MODELS["tiny"], num_layers=2)
    model = build_model(m, attention=attention)
    tokens = torch.randint(0, m.vocab_size, (2, 16))
    counted = count_flops(lambda: model(tokens).sum().backward())
    assert counted == planner.train_step_flops(m, batch=2, seq_len=16, attention=attention)


@pytest.mark.parametrize("cached", [False, True])
def test_planner_predicts_the_counted_generation_flops_exactly(cached):
    m = dataclasses.replace(MODELS["tiny"], num_layers=2)
    model = build_model(m)
    prompt = torch.randint(0, m.vocab_size, (2, 5))
    if cached:
        fn = lambda: kv_cache.generate_cached(model, prompt, 4, kv_cache.DynamicCache(2))  # noqa: E731
    else:
        fn = lambda: kv_cache.generate_uncached(model, prompt, 4)  # noqa: E731
    predicted = planner.generate_flops(m, batch=2, prompt_len=5, new_tokens=4, cached=cached)
    assert count_flops(fn) == predicted


def test_roofline_units_and_bound():
    p = roofline(2e12, 1.0, bytes_moved=1e9, peak_tflops=4.0, bandwidth_gbps=100.0)
    assert p.tflops == 2.0 and p.gbps == 1.0 and p.pct_peak_flops == 50.0 and p.pct_bandwidth == 1.0
    assert p.intensity == 2000.0 and p.bound == "compute"  # ridge at 40 FLOP/byte
    assert roofline(1e9, 1.0, bytes_moved=1e9, peak_tflops=4.0, bandwidth_gbps=100.0).bound == "memory"
    assert roofline(1e12, 1.0).pct_peak_flops is None


def test_views_of_tensors_made_before_the_meter_allocate_nothing():
    w = torch.nn.Parameter(torch.randn(64, 32))  # made outside: not ours to count
    with MemoryMeter("cpu") as meter:
        wt = w.t()  # a view: no new storage
        w2 = w.detach()
        y = torch.ones(8, 64) @ w
        assert meter.current_bytes == 8 * 64 * 4 + 8 * 32 * 4
        del wt, w2, y


def test_activation_meter_sees_what_checkpointing_keeps():
    from labkit.measure.memory import ActivationMeter
    from labkit.techniques.checkpointing import apply_checkpointing

    m = dataclasses.replace(MODELS["tiny"], num_layers=2)
    tokens = torch.randint(0, m.vocab_size, (2, 16))
    held = {}
    for mode in ("none", "full", "selective"):
        model = apply_checkpointing(build_model(m), mode)
        held[mode] = ActivationMeter(model.parameters()).measure(lambda: model(tokens).sum()).total_bytes
    assert held["full"] < held["selective"] < held["none"]
    d = m.hidden_size * 2 * 16 * 4  # one block input: (B, T, d) fp32
    logits = 2 * 16 * m.vocab_size * 4
    # full: each block keeps only its input; after the blocks, the final norm and the head keep theirs
    assert held["full"] < 2 * d + 4 * d + logits


@pytest.mark.slow  # a gloo group, and a buffer held past the wait
def test_activation_meter_waits_for_a_collectives_buffers_that_another_thread_lets_go_of(tmp_path):
    """An all-gather's input and output, or an all-to-all's input (c10d's own op, as Ulysses
    calls it), that another thread lets go of just after the forward (gloo's worker thread) are
    waited for and not counted; an output held until after the measurement (longer than any
    wait), or saved for backward, counts."""
    import threading
    import time

    import torch.distributed as dist

    from labkit.measure.memory import ActivationMeter

    w = torch.ones(64, 32, requires_grad=True)
    kept, gathered = 8 * 64 * 4, 1024 * 4

    def moment():
        time.sleep(0.05)

    def held(tensor, until):  # the "worker thread": holds `tensor` until `until()` returns
        threading.Thread(target=lambda t: until(), args=(tensor,)).start()

    def forward(hold=None, save=False):
        def run():
            group = dist.group.WORLD.group_name
            shard = torch.zeros(1024)
            buffer = torch.ops._c10d_functional.all_gather_into_tensor(shard, 1, group)
            buffer = torch.ops._c10d_functional.wait_tensor(buffer)
            held(shard, moment)  # the shard a moment, the gathered buffer until `hold()` returns
            if hold is not None:
                held(buffer, hold)
            # sin's (8, 64) output is kept for backward; so is the buffer, by `* w[0, 0]`
            return (torch.ones(8, 64).sin() @ w).sum(), (buffer * w[0, 0] if save else buffer).sum()
        return run

    def all_to_all():
        send = torch.zeros(1024)
        dist.all_to_all_single(torch.empty_like(send), send)
        held(send, moment)
        return (torch.ones(8, 64).sin() @ w).sum()

    dist.init_process_group("gloo", init_method=(tmp_path / "store").as_uri(), rank=0, world_size=1)
    try:
        assert ActivationMeter([w]).measure(forward(hold=moment)).total_bytes == kept
        release = threading.Event()  # held until after the measurement, longer than any wait
        try:
            assert ActivationMeter([w]).measure(forward(hold=release.wait)).total_bytes == kept + gathered
        finally:
            release.set()
        assert ActivationMeter([w]).measure(forward(save=True)).total_bytes == kept + gathered
        assert ActivationMeter([w]).measure(all_to_all).total_bytes == kept
    finally:
        dist.destroy_process_group()


def test_tracker_follows_storage_resizes_as_fsdp_frees_and_regathers():
    """FSDP2 frees a gathered parameter with storage.resize_(0), then gathers into it again."""
    original = torch.UntypedStorage.resize_
    with LiveTensorTracker() as tracker:
        x = torch.empty(1024)  # 4 KiB
        assert tracker.current_bytes == 4096
        x.untyped_storage().resize_(0)
        assert tracker.current_bytes == 0 and tracker.peak_bytes == 4096
        x.untyped_storage().resize_(8192)
        assert tracker.current_bytes == tracker.peak_bytes == 8192
    assert torch.UntypedStorage.resize_ is original  # restored on exit


@pytest.mark.slow
def test_frozen_survivors_are_left_out_and_a_later_cycle_is_still_freed():
    """freeze_survivors: what is alive now leaves the collector's walks; a tensor that dies later
    in a reference cycle is still freed by free_device_memory, and seen freed by the tracker."""
    from labkit.measure.memory import free_device_memory, freeze_survivors

    try:
        freeze_survivors()
        assert gc.get_freeze_count() > 1000  # the modules, classes and functions imported so far
        with LiveTensorTracker() as tracker:
            cycle = {"tensor": torch.empty(1024)}
            cycle["self"] = cycle
            assert tracker.current_bytes == 4096
            del cycle
            assert tracker.current_bytes == 4096  # a cycle: reference counts alone never free it
            free_device_memory("cpu")
            assert tracker.current_bytes == 0
        # a module imported since (a run's first variant imports peft): the next free freezes it
        gc.unfreeze()
        assert gc.get_freeze_count() == 0
        import types
        sys.modules["_labkit_just_imported"] = types.ModuleType("_labkit_just_imported")
        free_device_memory("cpu")
        assert gc.get_freeze_count() > 1000
    finally:
        sys.modules.pop("_labkit_just_imported", None)
        gc.unfreeze()


def test_comm_counter_counts_all_to_all_and_point_to_point_bytes_once():
    """On a fake 4-rank group (no transport): a send's bytes are on the link, a recv's are not
    counted twice, an all-to-all moves (n-1)/n of its input and an all-reduce 2(n-1)/n."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from labkit.measure.comm import CommCounter
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        x = torch.ones(8)  # 32 bytes
        with CommCounter() as counter:
            dist.send(x, 1)
            dist.recv(torch.empty(4), 2)
            dist.all_to_all_single(torch.empty(8), x)
            dist.all_reduce(x)
    finally:
        dist.destroy_process_group()
    assert dict(counter.bytes) == {"send": 32, "recv": 16, "all_to_all": 32, "all_reduce": 32}
    metrics = counter.metrics()
    assert metrics["comm_bytes"] == 32 * 3
    assert metrics["comm_bus_bytes"] == 32 + 32 * 3 / 4 + 32 * 2 * 3 / 4
    assert (metrics["send_count"], metrics["recv_count"], metrics["all_to_all_count"]) == (1, 1, 1)
