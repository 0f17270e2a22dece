"""The serving workload generator: seeded, within its ranges, arrivals as specified, and each
shipped workload is what its named spec generates."""
import json
import statistics

import pytest

from labkit.config import ConfigError
from labkit.hardware import DATA_DIR
from labkit.blocks.requests import (SHIPPED, WorkloadSpec, load_workload, make_requests,
                                        save_workload)


def test_the_same_seed_gives_the_same_requests_and_another_seed_others():
    assert make_requests(WorkloadSpec(seed=3)) == make_requests(WorkloadSpec(seed=3))
    assert make_requests(WorkloadSpec(seed=3)) != make_requests(WorkloadSpec(seed=4))


def test_lengths_and_classes_stay_in_their_ranges_and_shares():
    spec = WorkloadSpec(num_requests=4000, prompt_len=(8, 32), output_len=(8, 256))
    requests = make_requests(spec)
    assert {r.prompt_len for r in requests} <= set(range(8, 33))
    assert min(r.output_len for r in requests) == 8 and max(r.output_len for r in requests) == 256
    assert statistics.mean(r.output_len for r in requests) == pytest.approx(132, rel=0.03)
    high = sum(r.priority == "high" for r in requests) / len(requests)
    assert high == pytest.approx(0.25, abs=0.03)


def test_arrivals_poisson_bursty_and_closed():
    poisson = make_requests(WorkloadSpec(num_requests=4000, rate_per_s=20.0))
    gaps = [b.arrival_s - a.arrival_s for a, b in zip(poisson, poisson[1:])]
    assert min(gaps) >= 0 and statistics.mean(gaps) == pytest.approx(1 / 20, rel=0.05)
    bursty = make_requests(WorkloadSpec(num_requests=64, arrival="bursty", burst_size=8))
    assert len({r.arrival_s for r in bursty}) == 8  # 8 bursts of 8 requests each
    assert {r.arrival_s for r in make_requests(WorkloadSpec(arrival="closed"))} == {0.0}


def test_each_shipped_workload_is_its_named_spec_and_a_tampered_one_is_refused(tmp_path):
    files = sorted((DATA_DIR / "workloads").glob("*.json"))
    assert [f.stem for f in files] == sorted(SHIPPED)
    for f in files:
        spec, requests = load_workload(f)
        assert spec == SHIPPED[f.stem] and requests == make_requests(spec)
    assert SHIPPED["default"] == WorkloadSpec() and len(make_requests(WorkloadSpec())) == 64
    path = tmp_path / "w.json"
    save_workload(WorkloadSpec(seed=1), path)
    record = json.loads(path.read_text())
    record["requests"][0]["output_len"] += 1
    path.write_text(json.dumps(record))
    with pytest.raises(ConfigError, match="not those its spec generates"):
        load_workload(path)


def test_bad_specs_name_what_is_valid():
    with pytest.raises(ConfigError, match="valid: poisson, bursty, closed"):
        make_requests(WorkloadSpec(arrival="uniform"))
    with pytest.raises(ConfigError, match="1 <= low <= high"):
        make_requests(WorkloadSpec(output_len=(9, 8)))
