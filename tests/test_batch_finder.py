"""The batch finder under the CPU's virtual budget: what it finds fits and the next size does not,
and a search leaves nothing behind, failed probes included."""
import dataclasses
import gc
import math
import weakref

import pytest
import torch

from conftest import FAST
from labkit.config import resolve
from labkit.harness.experiment import run_experiment
from labkit.measure.memory import MemoryMeter
from labkit.techniques import batch_finder
from labkit.blocks.training import Trainer, optimizer_state

pytestmark = pytest.mark.slow  # this module's fixtures measure for seconds

BUDGET_GIB = 0.07  # 2-layer tiny model: ~62 MiB of weights, AdamW state and step temporaries
SIZES = {**FAST, "num_layers": 2, "seq_len": 8, "memory_budget_gib": BUDGET_GIB, "mode": "grow",
         "device": "cpu"}


def config(**overrides):
    return resolve(batch_finder.Config, "tiny", {**SIZES, **overrides},
                   experiment="batch_finder")


@pytest.fixture(scope="module")
def searched():
    """One search, watched: weak references to every probe's trainer, parameters and AdamW state,
    and the tracker's live bytes before and after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    refs = []

    def watch(n, trainer):
        refs.append((n, weakref.ref(trainer), [weakref.ref(p) for p in trainer.model.parameters()]))

        def after_step(opt, args, kwargs):  # AdamW's state exists once the first step has run
            refs[-1][2].extend(weakref.ref(t) for t in optimizer_state(opt))

        trainer.optimizer.register_step_post_hook(after_step)

    gc.collect()
    with MemoryMeter("cpu", int(BUDGET_GIB * 2**30)) as meter:
        before = meter.current_bytes
        search = batch_finder.search_frontier(config(), on_probe=watch)
        gc.collect()
        after = meter.current_bytes
    torch.set_num_threads(threads)
    return search, refs, before, after


def two_steps_fit(cfg, n) -> bool:
    """The claim itself, checked apart from the finder: a fresh plain Trainer at batch `n`, two
    steps (the second with AdamW's state resident), under the same virtual budget."""
    gc.collect()
    with MemoryMeter("cpu", int(BUDGET_GIB * 2**30)):
        try:
            trainer = Trainer(dataclasses.replace(cfg, batch_size=n), lr=cfg.lr)
            trainer.train(2)
            return True
        except torch.OutOfMemoryError:
            return False
        finally:
            trainer = None
            gc.collect()


def test_the_batch_found_fits_and_the_next_does_not(searched):
    search, *_ = searched
    assert 1 < search.found < search.cap  # neither nothing nor the cap: a real frontier
    assert two_steps_fit(config(), search.found)
    assert not two_steps_fit(config(), search.found + 1)
    assert (search.found, True) in search.probes and (search.found + 1, False) in search.probes
    # grow: doubling up to the first OOM, then bisection
    sizes = [n for n, _ in search.probes]
    first_miss = next(i for i, (_, ok) in enumerate(search.probes) if not ok)
    assert sizes[:first_miss + 1] == [2**i for i in range(first_miss + 1)]


def test_memory_is_back_to_the_baseline_and_failed_probes_are_gone(searched):
    search, refs, before, after = searched
    assert after == before == 0
    failed = {n for n, ok in search.probes if not ok}
    assert failed and {n for n, *_ in refs} >= failed
    for n, trainer, tensors in refs:
        assert trainer() is None, f"probe {n}'s trainer is alive"
        assert len(tensors) > 0 and all(t() is None for t in tensors), f"probe {n} left tensors"


def test_dynamic_mode_starts_from_the_free_memory_and_agrees(searched):
    search, *_ = searched
    gc.collect()
    with MemoryMeter("cpu", int(BUDGET_GIB * 2**30)):
        dynamic = batch_finder.search_frontier(config(mode="dynamic"))
    assert dynamic.found == search.found
    assert len(dynamic.probes) < len(search.probes) / 2


def test_find_largest_brackets_then_bisects():
    limit = 37
    grow = batch_finder.find_largest(lambda n: n <= limit, start=1, cap=100, step=1)
    assert grow.found == limit and [n for n, _ in grow.probes][:7] == [1, 2, 4, 8, 16, 32, 64]
    assert len(grow.probes) <= 2 * math.ceil(math.log2(limit)) + 1
    capped = batch_finder.find_largest(lambda n: True, start=1, cap=10, step=1)
    assert capped.found == 10 and capped.capped
    assert batch_finder.find_largest(lambda n: False, start=1, cap=10, step=1).found == 0
    up = batch_finder.find_largest(lambda n: n <= limit, start=36, cap=100, step=1)
    assert up.found == limit and [n for n, _ in up.probes] == [36, 37, 39, 38]
    down = batch_finder.find_largest(lambda n: n <= limit, start=40, cap=100, step=1)
    assert down.found == limit and down.probes[0] == (40, False)
    # not monotone: still a size that fits next to one that does not
    odd = batch_finder.find_largest(lambda n: n % 7 != 0 and n < 50, start=1, cap=64, step=1)
    assert (odd.found, True) in odd.probes and (odd.found + 1, False) in odd.probes


def test_accumulation_keeps_the_effective_batch_and_its_gradient():
    assert batch_finder.micro_batches(100, 24) == [24, 24, 24, 24, 4]
    assert batch_finder.step_sizes(config(batch_size=24, effective_batch=100)) == [24] * 4 + [4]
    assert batch_finder.step_sizes(config(batch_size=24, effective_batch=10)) == [10]
    assert batch_finder.probe_sizes(config(batch_size=24, effective_batch=100)) == [24, 24]
    grads = []

    def keep(opt, args, kwargs):
        grads.append([p.grad.clone() for group in opt.param_groups for p in group["params"]])

    losses = []
    for sizes in ([5], [2, 2, 1]):
        trainer = batch_finder.frontier_step(config(batch_size=5), sizes)
        trainer.optimizer.register_step_pre_hook(keep)
        losses.append(trainer.step())
    assert losses[0] == pytest.approx(losses[1], rel=1e-6)
    assert all(torch.allclose(a, b, atol=1e-7, rtol=1e-4) for a, b in zip(*grads))


def test_rows_from_the_harness_with_accumulation():
    rows = run_experiment("batch_finder", preset="tiny", variants=["fp32_ckpt"], progress=False,
                          overrides={**SIZES, "effective_batch": 40, "max_batch_size": 32}).rows
    assert {r["status"] for r in rows} == {"ok"}
    by = {(r["variant"], r["metric"]): r for r in rows}
    found = {v: by[(v, "max_batch_size")]["value"] for v in ("fp32", "fp32_ckpt")}
    assert found["fp32_ckpt"] > found["fp32"] >= 1  # recomputation lifts the frontier
    for v in found:
        assert by[(v, "max_batch_size")]["predicted"] >= 1  # the planner's napkin answer
        assert by[(v, "accumulation_steps")]["value"] == math.ceil(40 / found[v])
        assert by[(v, "num_probes")]["value"] >= 2
        assert by[(v, "peak_mem_bytes")]["value"] <= BUDGET_GIB * 2**30
        assert by[(v, "tokens_per_s")]["value"] > 0
    assert by[("fp32_ckpt", "max_size_ratio")]["value"] == found["fp32_ckpt"] / found["fp32"]


def test_the_cpu_without_a_budget_is_refused_with_the_reason():
    rows = run_experiment("batch_finder", preset="tiny", progress=False,
                          overrides={**SIZES, "memory_budget_gib": None}).rows
    assert len(rows) == len(batch_finder.VARIANTS)
    assert all(r["status"] == "skipped" and "memory_budget_gib" in r["message"] for r in rows)


@pytest.mark.parametrize("native, fp32, bf16, skipped", [
    (True, 0.1, 0.4, False),  # AVX-512 BF16 at work: bf16 faster than fp32
    (True, 0.1, 0.003, True),  # the flags say bf16, the measured rate says emulated
    (False, 0.07, 0.001, True),  # AVX2 only
])
def test_bf16_searches_are_skipped_where_the_cpu_emulates_bf16(monkeypatch, native, fp32, bf16,
                                                              skipped):
    from labkit import hardware

    flags = ("avx2", "avx512_bf16") if native else ("avx2",)
    cpu = dataclasses.replace(hardware.cpu_info(), flags=flags)
    ceil = dataclasses.replace(hardware.ceilings("cpu"),
                               calibrated_tflops={"float32": fp32, "bfloat16": bf16})
    monkeypatch.setattr(hardware, "cpu_info", lambda: cpu)
    monkeypatch.setattr(hardware, "ceilings", lambda *a, **k: ceil)
    cfg = resolve(batch_finder.Config, "tiny", {"device": "cpu", "variant": "bf16"},
                  experiment="batch_finder")
    reason = batch_finder.skip_reason(cfg)
    assert (reason is not None) == skipped
    if skipped:
        assert f"{bf16 * 1e3:.3g} GFLOP/s against fp32's {fp32 * 1e3:.3g}" in reason
