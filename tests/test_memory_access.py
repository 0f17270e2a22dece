import pytest
import torch

from conftest import FAST, by

from labkit.config import ConfigError, resolve
from labkit.harness.experiment import run_experiment
from labkit.techniques import memory_access

pytestmark = pytest.mark.slow  # this module's fixtures measure for seconds

SIZES = {**FAST, "size_mib": 1, "stride": 4, "device": "cpu"}
N = 2**20 // 4  # float32 values in 1 MiB


def _run(tmp_path_factory, **kw):
    return run_experiment("memory_access", preset="tiny", overrides={**SIZES, **kw}, progress=False,
                          runs_dir=str(tmp_path_factory.mktemp("runs"))).rows


@pytest.fixture(scope="module")
def copies(tmp_path_factory):
    return _run(tmp_path_factory)


@pytest.fixture(scope="module")
def sums(tmp_path_factory):
    return _run(tmp_path_factory, op="sum")


def _cfg(**kw):
    return resolve(memory_access.Config, "tiny", {**SIZES, **kw}, experiment="memory_access")


def test_every_access_pattern_copies_exactly_the_reference_values(copies, sums):
    for rows in (copies, sums):
        assert all(r["status"] == "ok" for r in rows)
        for variant in memory_access.VARIANTS:
            assert by(rows, variant, "max_abs_diff")["value"] == 0.0


def test_bytes_held_are_measured_from_storage_and_match_the_layout(copies):
    assert by(copies, "contiguous", "src_bytes")["value"] == N * 4
    assert by(copies, "strided", "src_bytes")["value"] == 4 * N * 4  # the buffer the view spans
    assert by(copies, "gather", "index_bytes")["value"] == N * 8
    for variant in memory_access.VARIANTS:
        for metric in ("src_bytes", "dst_bytes"):
            row = by(copies, variant, metric)
            assert row["value"] == row["predicted"]


def step_bytes(cfg) -> tuple[int, int]:
    """Bytes of what one step reads (the values, the gather's index) and writes (its result),
    from the tensors themselves, and the values summed (one add each, `op=sum`)."""
    values = torch.zeros(memory_access.matrix_shape(cfg))
    source = memory_access.make_source(cfg, values)
    read = values.nbytes + (source["index"].nbytes if "index" in source else 0)
    out = memory_access.build(cfg).step()
    return read + out.nbytes, values.numel()


def test_gbps_and_tflops_count_the_bytes_and_adds_of_the_tensors(sums):
    for variant, moved in (("contiguous", 2 * N * 4), ("gather", 2 * N * 4 + N * 8),
                           ("strided", 2 * N * 4), ("transposed", 2 * N * 4)):
        cfg = _cfg(variant=variant)
        assert step_bytes(cfg) == (moved, N)
        assert memory_access.build(cfg).per_second == {"gbps": moved / 1e9}
    cfg = _cfg(op="sum")
    moved = (N + 512) * 4  # 1 MiB as a 512 x 512 matrix: one fp32 sum written per row
    assert step_bytes(cfg) == (moved, N)
    assert memory_access.build(cfg).per_second == {"gbps": moved / 1e9, "tflops": N / 1e12}
    # the rows' rates share one step time: their ratio is bytes per add, whatever the time
    row = {m: by(sums, "contiguous", m)["value"] for m in ("gbps", "tflops")}
    assert row["gbps"] / row["tflops"] == pytest.approx(1e3 * moved / N)


def test_the_prediction_counts_whole_lines():
    """64-byte lines: stride 4 fetches 16 bytes per value, stride 32 a whole line; gather a line."""
    for stride, per_value in ((2, 8), (4, 16), (16, 64), (32, 64)):
        cfg = _cfg(variant="strided", stride=stride)
        assert memory_access.traffic_bytes(cfg) == N * per_value + N * 4
    assert memory_access.traffic_bytes(_cfg(variant="gather")) == N * 64 + N * 8 + N * 4
    assert memory_access.traffic_bytes(_cfg()) == memory_access.useful_bytes(_cfg()) == 2 * N * 4


def test_the_gather_index_is_a_permutation_and_the_strided_fill_is_never_read():
    cfg = _cfg(variant="gather")
    values = -torch.arange(N, dtype=torch.float32).view(512, 512)  # never FILL (2.0)
    source = memory_access.make_source(cfg, values)
    assert torch.equal(source["index"].sort().values, torch.arange(N))
    assert torch.equal(source["src"][source["index"]], values.flatten())
    strided = memory_access.make_source(_cfg(variant="strided"), values)
    assert torch.equal(strided["view"], values) and (strided["src"] == memory_access.FILL).sum() == 3 * N


def test_a_wrong_result_is_a_mismatch():
    reference = {"out": torch.zeros(4)}
    comparison = memory_access.compare(reference, {"out": torch.tensor([0.0, 1.0, 0.0, 0.0])}, _cfg())
    assert not comparison.ok and comparison.metrics["max_abs_diff"] == 1.0


def test_bad_settings_are_refused_naming_the_valid_choices():
    with pytest.raises(ConfigError, match="valid: copy, sum"):
        _cfg(op="max")
    with pytest.raises(ConfigError, match="stride"):
        _cfg(stride=1)
    with pytest.raises(ConfigError, match="dtype must be float32"):
        memory_access.validate(_cfg(dtype="bf16"))
    with pytest.raises(ConfigError, match="valid: >= 0.004"):
        memory_access.validate(_cfg(size_mib=0.001))
