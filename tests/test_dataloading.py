import dataclasses

import pytest
import torch

from conftest import TINY_TRAIN, by

from labkit.config import ConfigError, resolve
from labkit.harness.experiment import run_experiment
from labkit.techniques import dataloading

pytestmark = pytest.mark.slow  # this module's fixtures measure for seconds

SIZES = {**TINY_TRAIN, "batch_size": 2, "steps": 3, "epoch_steps": 6, "sample_cost_us": 300.0,
         "device": "cpu"}


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    return run_experiment("dataloading", preset="tiny", overrides=SIZES, progress=False,
                          runs_dir=str(tmp_path_factory.mktemp("runs"))).rows


def _cfg(variant="baseline", **kw):
    cfg = resolve(dataloading.Config, "tiny", {**SIZES, **kw}, experiment="dataloading")
    return dataclasses.replace(cfg, variant=variant)


def test_every_variant_trains_on_the_same_batches_to_the_same_losses(rows):
    assert all(r["status"] == "ok" for r in rows)
    for variant in dataloading.VARIANTS:
        assert by(rows, variant, "batches_match")["value"] == 1.0
        assert by(rows, variant, "loss_delta")["value"] == 0.0
        assert by(rows, variant, "loss")["value"] == by(rows, "baseline", "loss")["value"]


def test_data_wait_is_a_share_of_the_step_and_h2d_only_on_cuda(rows):
    for variant in dataloading.VARIANTS:
        wait = by(rows, variant, "data_wait_pct")
        assert 0.0 <= wait["value"] <= 100.0 and 0.0 <= wait["predicted"] <= 100.0
        assert by(rows, variant, "compute_ms")["value"] > 0
        assert by(rows, variant, "first_batch_ms")["value"] > 0
        assert by(rows, variant, "data_ms")["value"] >= 0
    assert not [r for r in rows if r["metric"] == "h2d_gbps"]
    assert "no host-to-device copy" in by(rows, "pinned", "step_ms")["message"]
    assert by(rows, "baseline", "data_ms")["predicted"] == pytest.approx(2 * 300 / 1e3)


def test_one_stalled_step_does_not_decide_the_wait():
    """The wait and compute are the median step's: a step stalled by something else on the
    machine (here 84 ms in next()) moves neither, where a sum over the steps doubled the share."""
    feed = dataloading.LoaderFeed(_cfg())
    feed.records = [(0.001, 0.100, 0.0), (0.002, 0.110, 0.0), (0.084, 0.200, 0.0)]
    out = feed.report()
    assert out["data_ms"] == pytest.approx(2.0) and out["compute_ms"] == pytest.approx(108.0)
    assert out["data_wait_pct"] == pytest.approx(100 * 2.0 / (2.0 + 108.0))
    assert feed.predicted()["step_ms"] == pytest.approx(108.0 + dataloading.data_ms(feed.cfg))


def test_loaders_with_and_without_workers_yield_identical_batches():
    """The mechanism behind equal losses: per-index seeded samples and a seeded shuffle drawn in
    the main process, whichever process builds the samples."""
    def first_batches(cfg, n=4):
        loader = dataloading.make_loader(cfg, dataloading.make_dataset(cfg))
        it = iter(loader)
        return [next(it) for _ in range(n)]

    plain = first_batches(_cfg())
    for start_method in ("fork", "forkserver"):
        workers = first_batches(_cfg("workers", start_method=start_method, num_workers=2))
        for a, b in zip(plain, workers):
            assert torch.equal(a["tokens"], b["tokens"]) and torch.equal(a["checksum"], b["checksum"])
    other_seed = first_batches(_cfg(seed=1))
    assert not torch.equal(plain[0]["tokens"], other_seed[0]["tokens"])


def test_samples_depend_only_on_seed_and_index_and_the_work_is_real():
    cfg = _cfg(sample_cost_us=1000.0)
    a, b = dataloading.make_dataset(cfg), dataloading.make_dataset(cfg)
    assert a.rounds > 0 and len(a) == 6 * 2
    assert torch.equal(a[5]["tokens"], b[5]["tokens"]) and a[5]["checksum"] == b[5]["checksum"]
    assert a[5]["tokens"].shape == (cfg.seq_len + 1,) and int(a[5]["tokens"].max()) < cfg.model.vocab_size
    assert dataloading.make_dataset(_cfg(sample_cost_us=0.0)).rounds == 0


def test_compare_refuses_other_batches_or_losses():
    ref = {"losses": [1.0, 0.9], "tokens": [torch.ones(2, 3)], "checksums": [torch.ones(2)]}
    assert dataloading.compare(ref, ref, _cfg()).ok
    other = {**ref, "tokens": [torch.zeros(2, 3)]}
    assert "batches differ" in dataloading.compare(ref, other, _cfg()).message
    assert not dataloading.compare(ref, {**ref, "losses": [1.0, 0.8]}, _cfg()).ok


@pytest.mark.parametrize("bad, match", [
    ({"start_method": "thread"}, "valid: forkserver, spawn, fork"),
    ({"num_workers": 0}, "num_workers=0"),
    ({"epoch_steps": 2}, "epoch_steps=2"),
    ({"dtype": "bf16"}, "valid: float32"),
    ({"sample_cost_us": -1}, "sample_cost_us=-1"),
])
def test_bad_knobs_are_refused(bad, match):
    with pytest.raises(ConfigError, match=match):
        run_experiment("dataloading", preset="tiny", overrides={**SIZES, **bad}, progress=False)
