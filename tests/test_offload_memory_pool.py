"""Offload and the caching allocator: on the CPU the reference runs and the variants are skipped
with the reason; the mechanisms behind the GPU variants are proven on the CPU."""
import dataclasses
import warnings

import pytest
import torch

from conftest import FAST, TINY_TRAIN
from labkit.config import resolve
from labkit.harness.experiment import run_experiment
from labkit.techniques import memory_pool, offload
from labkit.techniques.kv_cache import DynamicCache, generate_cached
from labkit.blocks.training import CopyAdamW, Trainer
from labkit.blocks.transforms import save_activations_on_host
from labkit.blocks.model import build_model

POOL_SIZES = {**FAST, "num_layers": 2, "prompt_len": 8, "new_tokens": 6, "batch_size": 2, "device": "cpu"}


def rows_of(rows, variant):
    return [r for r in rows if r["variant"] == variant]


def value(rows, variant, metric):
    hits = [r for r in rows_of(rows, variant) if r["metric"] == metric]
    assert len(hits) == 1, (variant, metric, hits)
    return hits[0]


@pytest.mark.slow
def test_offload_on_the_cpu_runs_the_reference_and_skips_the_rest_with_the_reason():
    rows = run_experiment("offload", preset="tiny", overrides={**TINY_TRAIN, "device": "cpu"},
                          progress=False).rows
    assert {r["status"] for r in rows_of(rows, "none")} == {"ok"}
    peak = value(rows, "none", "peak_mem_bytes")
    assert peak["predicted"] and 0.9 < peak["value"] / peak["predicted"] < 1.1
    assert value(rows, "none", "loss_delta")["value"] == 0.0
    # the device is the host: all of the optimizer state is "device" state, as predicted
    opt = value(rows, "none", "device_optimizer_bytes")
    assert opt["value"] == value(rows, "none", "optimizer_bytes")["value"] > 0
    for variant in ("activations", "optimizer", "both"):
        skipped = rows_of(rows, variant)
        assert len(skipped) == 1 and skipped[0]["status"] == "skipped"
        assert "nothing to offload to" in skipped[0]["message"] and "host memory" in skipped[0]["message"]
    # never a fake saving: no transfer or saving rows without a device to save on
    assert not {"device_mem_saved_bytes", "transfer_bytes", "added_step_ms"} & {r["metric"] for r in rows}


def test_activations_go_through_the_host_hooks_and_weights_stay_put():
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(16, 32))
    x = torch.randn(4, 32, requires_grad=True)

    def loss(hooks=None):
        with hooks or torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            out = torch.nn.functional.linear(x, w).relu()  # (4, 16)
        out.sum().backward()
        grads = (x.grad.clone(), w.grad.clone())
        x.grad = w.grad = None
        return grads

    hooks = save_activations_on_host([w])
    assert all(torch.equal(a, b) for a, b in zip(loss(), loss(hooks)))
    # linear saves x and w.t() (a view of the weight: not moved); relu saves its output
    assert hooks.bytes_to_host == x.numel() * 4 + 4 * 16 * 4


@pytest.mark.slow
def test_offloaded_training_gives_the_reference_numbers():
    """Both offloads at once, on the CPU (unpinned): the same losses and gradient norm, exactly."""
    cfg = resolve(offload.Config, "tiny", {**TINY_TRAIN, "device": "cpu", "steps": 3})
    reference = Trainer(cfg, lr=cfg.lr).train(3)
    trainer = offload.offload_step(dataclasses.replace(cfg, variant="both"))
    got = trainer.train(3)
    assert got == reference
    assert isinstance(trainer.optimizer, CopyAdamW) and trainer.optimizer.copies[0].device.type == "cpu"
    params = sum(p.numel() for p in trainer.model.parameters())
    assert trainer.optimizer.bytes_per_step == 2 * 4 * params  # gradients down, weights up
    assert offload.transfer_bytes(trainer) > trainer.optimizer.bytes_per_step  # plus the activations
    state = sum(t.numel() * t.element_size() for t in trainer.optimizer_tensors()
                if t.dim())  # leave out AdamW's scalar step counters
    assert state == 12 * params  # fp32 weights + two moments, in host memory


@pytest.mark.slow
def test_memory_pool_on_the_cpu_runs_the_reference_and_skips_the_rest_with_the_reason():
    rows = run_experiment("memory_pool", preset="tiny", overrides=POOL_SIZES, progress=False).rows
    assert {r["status"] for r in rows_of(rows, "default")} == {"ok"}
    assert value(rows, "default", "token_agreement")["value"] == 1.0
    kv = value(rows, "default", "kv_bytes")
    assert kv["value"] == kv["predicted"] > 0
    for variant in ("expandable", "buffer_pool"):
        skipped = rows_of(rows, variant)
        assert len(skipped) == 1 and skipped[0]["status"] == "skipped"
        assert "no caching allocator on the CPU" in skipped[0]["message"]
    assert not {"reserved_bytes", "fragmentation_bytes"} & {r["metric"] for r in rows}


def test_the_buffer_pool_gives_the_same_tokens_and_allocates_no_cache():
    cfg = resolve(memory_pool.Config, "tiny", POOL_SIZES)
    model = build_model(cfg.model, seed=0).eval()
    prompts = torch.randint(0, cfg.model.vocab_size, (cfg.batch_size, cfg.prompt_len))
    pool = memory_pool.KVPool(cfg)
    buffers = [t.data_ptr() for t in pool.tensors()]
    for p, n in memory_pool.schedule(cfg):
        fresh = generate_cached(model, prompts[:, :p], n, DynamicCache(cfg.model.num_layers))
        pooled = generate_cached(model, prompts[:, :p], n, pool.reset())
        assert torch.equal(fresh, pooled)
        assert pool.lengths == [p + n - 1] * cfg.model.num_layers  # the last token is not fed back
    assert [t.data_ptr() for t in pool.tensors()] == buffers  # the same memory, every request
    new = torch.ones(cfg.batch_size, cfg.model.num_kv_heads, 3, cfg.model.head_dim)  # 3 tokens
    k, _ = pool.reset().update(0, new, new)
    assert k.shape[2] == 3 and k.untyped_storage().data_ptr() == buffers[0]  # a view of the pool


def test_expandable_segments_are_set_inside_and_the_environment_restored(monkeypatch):
    calls = []
    monkeypatch.setattr(memory_pool, "set_allocator_settings", calls.append)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128,expandable_segments:True")
    with pytest.raises(RuntimeError):
        with memory_pool.expandable_segments(False):
            raise RuntimeError("an OOM, say")
    assert calls == ["expandable_segments:False", "expandable_segments:True"]
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    with memory_pool.expandable_segments(True):
        pass
    assert calls[2:] == ["expandable_segments:True", "expandable_segments:False"]


def test_allocator_settings_go_through_the_cuda_setter_quietly(monkeypatch, recwarn):
    calls = []

    def deprecated(settings):  # what torch 2.13 does: a FutureWarning, then the work
        warnings.warn("use torch._C._accelerator_setAllocatorSettings", FutureWarning)
        calls.append(settings)

    monkeypatch.setattr(torch.cuda.memory, "_set_allocator_settings", deprecated)
    memory_pool.set_allocator_settings("expandable_segments:True")
    assert calls == ["expandable_segments:True"] and not recwarn.list


def test_allocator_peaks_read_the_documented_counters(monkeypatch):
    stats = {"allocated_bytes.all.peak": 100, "reserved_bytes.all.peak": 160,
             "inactive_split_bytes.all.peak": 20, "num_alloc_retries": 1}
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda device=None: stats)
    assert memory_pool.allocator_peaks("cuda") == {
        "allocated_bytes": 100, "reserved_bytes": 160, "fragmentation_bytes": 60,
        "inactive_split_bytes": 20, "alloc_retries": 1}


def test_expandable_bytes_count_only_this_devices_expandable_segments(monkeypatch):
    segments = [{"device": 0, "total_size": 2 << 20, "is_expandable": True},
                {"device": 0, "total_size": 20 << 20, "is_expandable": False},
                {"device": 1, "total_size": 4 << 20, "is_expandable": True}]
    monkeypatch.setattr(torch.cuda, "memory_snapshot", lambda *a, **k: segments)
    assert memory_pool.expandable_bytes("cuda:0") == 2 << 20
    assert memory_pool.expandable_bytes("cuda:1") == 4 << 20


def test_the_gpu_variants_say_why_they_do_not_run_here():
    off = resolve(offload.Config, "tiny", {"device": "cpu"})
    pool = resolve(memory_pool.Config, "tiny", {"device": "cpu"})
    assert offload.skip_reason(off) is None  # the reference
    assert "host memory" in offload.skip_reason(dataclasses.replace(off, variant="optimizer"))
    assert memory_pool.skip_reason(pool) is None
    assert "system allocator" in memory_pool.skip_reason(dataclasses.replace(pool, variant="buffer_pool"))
