"""sla: SLO attainment and goodput, the rate bisection, the Pareto front and the cost formula on
hand-built numbers; the experiment at tiny sizes, its rows and its exact predictions."""
import math

import pandas as pd
import pytest

from labkit.blocks import slo as slos
from labkit.blocks.requests import Request, WorkloadSpec
from labkit.blocks.serving import Sequence
from labkit.config import resolve
from labkit.harness.experiment import run_experiment
from labkit.techniques import sla
from labkit.views.serving import cost_figure, pareto_figure, serving_points

# 6 requests of at most 8 tokens, 2 layers, 2 bisection steps: seconds, not minutes
SIZES = {"num_requests": 6, "max_output_len": 8, "num_layers": 2, "batch_size": 4,
         "search_steps": 2}


def seq(i, arrival, first, finish, output_len):
    s = Sequence(req=Request(id=i, arrival_s=arrival, prompt_len=4, output_len=output_len,
                             priority="low"), prompt=[0] * 4)
    s.first_token_s, s.finish_s = first, finish
    return s


# TTFTs 0.1, 0.3, 0.1, 0.05; TPOTs (0.5-0.1)/4 = 0.1, (0.5-0.3)/4 = 0.05, (1.1-0.1)/5 = 0.2, none
HAND = [seq(0, 0.0, 0.1, 0.5, 5), seq(1, 0.0, 0.3, 0.5, 5), seq(2, 0.0, 0.1, 1.1, 6),
        seq(3, 1.0, 1.05, 1.05, 1)]
ARRIVAL = lambda s: s.req.arrival_s  # noqa: E731


def test_latencies_attainment_and_goodput_on_hand_built_sequences():
    lat = slos.request_latencies(HAND, ARRIVAL)
    assert [round(t, 9) for t, _ in lat] == [0.1, 0.3, 0.1, 0.05]
    assert [None if p is None else round(p, 9) for _, p in lat] == [0.1, 0.05, 0.2, None]
    slo = slos.Slo(ttft_s=0.2, tpot_s=0.15)
    # request 1 misses TTFT, request 2 misses TPOT, request 3 has no TPOT and meets TTFT
    assert slos.slo_met(lat, slo) == [True, False, False, True]
    out = slos.slo_summary(lat, slo, duration_s=2.0)
    assert out == {"slo_attainment": 0.5, "goodput_requests_per_s": 1.0,
                   "ttft_attainment": 0.75, "tpot_attainment": 0.75}


def test_certain_misses_counts_only_what_is_already_decided():
    slo = slos.Slo(ttft_s=0.2, tpot_s=0.15)
    waiting = seq(4, 0.0, None, None, 5)
    running = seq(5, 0.0, 0.1, None, 5)  # 4 tokens after the first may take 4 x 0.15 = 0.6 s
    assert slos.certain_misses([waiting, running], ARRIVAL, 0.15, slo) == 0
    assert slos.certain_misses([waiting, running], ARRIVAL, 0.25, slo) == 1  # no first token yet
    assert slos.certain_misses([waiting, running], ARRIVAL, 0.75, slo) == 2  # 0.65 s > 0.6 s
    assert slos.certain_misses(HAND, ARRIVAL, 0.5, slo) == 2  # request 3 not yet arrived
    assert slos.certain_misses(HAND, ARRIVAL, 2.0, slo) == 2


@pytest.mark.parametrize("threshold", [1.7, 5.0, 9.9])
def test_bisection_brackets_the_threshold_in_the_stated_steps(threshold):
    calls = []

    def measure(rate):
        calls.append(rate)
        return {"slo_attainment": 1.0 if rate <= threshold else 0.5}

    search = slos.bisect_rate(measure, 1.0, 16.0, target=0.9, steps=6)
    assert len(calls) == len(search.tried) == 6
    assert search.low_per_s <= threshold < search.high_per_s
    assert search.high_per_s / search.low_per_s == pytest.approx(16 ** (2 ** -6))
    assert search.found and search.max_requests_per_s == search.low_per_s
    assert threshold / search.max_requests_per_s < 16 ** (2 ** -6)  # within the final bracket


def test_bisection_below_the_bracket_reports_no_rate():
    search = slos.bisect_rate(lambda r: {"slo_attainment": 0.0, "rate": r}, 2.0, 8.0,
                              target=0.9, steps=3)
    assert not search.found and search.max_requests_per_s == 0.0
    assert search.at_max["rate"] == min(r for r, _ in search.tried)  # the lowest rate's numbers
    with pytest.raises(ValueError):
        slos.bisect_rate(lambda r: {}, 4.0, 2.0, target=0.9, steps=1)


def test_arrivals_at_a_rate_scale_as_its_inverse_and_keep_lengths():
    spec = WorkloadSpec(num_requests=8, arrival="closed", output_len=(4, 9))
    requests = [Request(id=i, arrival_s=0.0, prompt_len=3 + i, output_len=2 + i, priority="low")
                for i in range(5)]
    slow, fast = slos.at_rate(spec, requests, 10.0), slos.at_rate(spec, requests, 40.0)
    for a, b, r in zip(slow, fast, requests):
        assert (a.prompt_len, a.output_len) == (b.prompt_len, b.output_len) == (r.prompt_len, r.output_len)
        assert a.arrival_s == pytest.approx(4 * b.arrival_s)
    assert all(x.arrival_s < y.arrival_s for x, y in zip(slow, slow[1:]))


def test_pareto_front_cost_and_saturation_formulas():
    points = [(1, 10), (2, 8), (3, 3), (1.5, 7), (3, 3), (0.5, 10)]
    assert slos.pareto_front(points) == [True, True, True, False, True, False]
    assert slos.usd_per_million_tokens(3.6, 1000.0) == pytest.approx(1.0)  # 1e-3 USD/s / 1e3 tok/s
    assert slos.saturation_rate(8, 20, 0.005) == pytest.approx(80.0)  # 8 rows / (20 x 5 ms)


def fake_frame():
    rows = []
    for variant, b, user, device in [("sequential", 4, 900, 900), ("continuous", 2, 600, 1100),
                                     ("continuous", 4, 400, 1500), ("static", 4, 300, 1000)]:
        for metric, value in (("user_tokens_per_s", user), ("useful_tokens_per_s", device),
                              ("usd_per_million_tokens", slos.usd_per_million_tokens(2.0, device))):
            rows.append({"variant": variant, "params": {"batch_size": b}, "metric": metric,
                         "value": float(value), "status": "ok"})
    return pd.DataFrame(rows)


def test_figures_mark_the_front():
    points = serving_points(fake_frame())
    assert list(points["on_front"]) == [True, True, True, False]  # static: beaten on both
    assert points["on_cost_front"].tolist() == points["on_front"].tolist()  # cost falls as tokens/s rise
    for fig in (pareto_figure(fake_frame()), cost_figure(fake_frame())):
        front = next(t for t in fig.data if t.name == "Pareto front")
        assert list(front.x) == [400, 600, 900]
    assert {t.name for t in fig.data} == {"sequential", "continuous", "static", "Pareto front"}


def test_objectives_scale_the_baselines_unless_set():
    cfg = resolve(sla.Config, "tiny", {"device": "cpu"}, experiment="sla")
    slo = sla.objectives(cfg, (0.004, 0.001))
    assert (slo.ttft_s, slo.tpot_s) == pytest.approx((cfg.ttft_slo_scale * 0.004, cfg.tpot_slo_scale * 0.001))
    cfg = resolve(sla.Config, "tiny", {"device": "cpu", "ttft_slo_ms": 50.0}, experiment="sla")
    assert sla.objectives(cfg, (0.004, 0.001)).ttft_s == pytest.approx(0.05)


def value(frame, variant, metric, column="value"):
    rows = frame[(frame.variant == variant) & (frame.metric == metric)]
    assert len(rows) == 1, (variant, metric)
    return rows[column].iloc[0]


@pytest.fixture(scope="module")
def frame(tmp_path_factory):
    return run_experiment("sla", preset="tiny", overrides=SIZES, variants=["continuous"],
                          progress=False, runs_dir=str(tmp_path_factory.mktemp("runs"))).frame()


@pytest.mark.slow
def test_experiment_rows_and_exact_predictions(frame):
    ok = frame[frame.metric.notna() & (frame.status == "ok")]
    assert set(ok.variant) == {"sequential", "continuous"}
    for variant in ("sequential", "continuous"):
        assert value(frame, variant, "logprob_max_abs_diff") <= 1e-3
        assert value(frame, variant, "rates_tried") == value(frame, variant, "rates_tried", "predicted") == 2
        assert value(frame, variant, "bracket_ratio") == pytest.approx(
            value(frame, variant, "bracket_ratio", "predicted"))
        sat, top = value(frame, variant, "saturation_requests_per_s"), value(frame, variant, "max_requests_per_s")
        assert 0 <= top <= sat and value(frame, variant, "max_requests_per_s", "predicted") > 0
        price = frame[frame.variant == variant].params.iloc[0]["price_per_hour"]
        assert value(frame, variant, "usd_per_million_tokens") == pytest.approx(
            slos.usd_per_million_tokens(price, value(frame, variant, "useful_tokens_per_s")))
    # every scheduler is held to one SLO
    assert value(frame, "sequential", "ttft_slo_ms") == value(frame, "continuous", "ttft_slo_ms")


@pytest.mark.slow
def test_a_hopeless_slo_stops_every_replay_and_finds_no_rate(tmp_path):
    frame = run_experiment("sla", preset="tiny", overrides={**SIZES, "ttft_slo_ms": 1e-3},
                           variants=["sequential"], progress=False, runs_dir=str(tmp_path)).frame()
    assert value(frame, "sequential", "max_requests_per_s") == 0.0
    assert value(frame, "sequential", "replays_stopped") == 2
    assert math.isclose(value(frame, "sequential", "ttft_slo_ms"), 1e-3)


def test_exercises_grade_the_formula_and_the_mistake():
    from labkit.study.exercises import core
    from labkit.study.exercises import sla as sla_exercises
    from labkit.study.exercises.runs import RUNS

    setup = core.Setup(RUNS["sla"], "cpu")
    found = {ex.key: ex for ex in sla_exercises.build_exercises()}
    assert set(found) == {"sla_saturation", "sla_cost"}
    # by hand: 16 rows / (250 tokens x 0.025 s) = 2.56 requests/s; 3 / 3600 / 1500 x 1e6 USD
    for key, by_hand in (("sla_saturation", 2.56), ("sla_cost", 3 / 3600 / 1500 * 1e6)):
        ex = found[key]
        reference = ex.answer(setup)
        assert reference == pytest.approx(by_hand)
        assert core.grade(ex, by_hand * 1.01, reference)
        assert not core.grade(ex, ex.mistake(setup), reference) and ex.is_mistake(ex.mistake(setup), setup)
    rows = core.Rows([{"variant": "continuous", "metric": m, "value": v, "params": {"sweep": {}}}
                      for m, v in (("decode_step_ms", 2.0), ("saturation_requests_per_s", 30.0),
                                   ("max_requests_per_s", 20.0), ("useful_tokens_per_s", 500.0),
                                   ("usd_per_million_tokens", 1.1))], "test")
    for ex in found.values():
        values = {**ex.evidence(rows, setup), "answer": core.show(ex.answer(setup), ex.unit),
                  "prediction": ""}
        assert "{" not in ex.why.format(**values)
