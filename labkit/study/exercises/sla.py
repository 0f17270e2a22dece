"""Exercises on serving under an SLO (`labkit.techniques.sla`): the saturation rate from slots,
output length and step time, and the cost per million tokens from a price and a throughput.

Both are predicted from their formulas (`labkit.blocks.slo`) on the numbers their scenarios state,
then shown beside the tiny run (`RUNS["sla"]` in `labkit.study.exercises.runs`), where the same
formulas meet the measured step and throughput.

Their words are in notebooks/exercises/text/KEY.md, one file per exercise (`text` reads them)."""
from __future__ import annotations

from labkit.blocks import slo as slos
from labkit.techniques import batching
from labkit.study.exercises.core import TOPICS, Exercise, Rows, Setup, close, show

# The saturation scenario: a GPU server's full decode step and its requests' mean output
ROWS, STEP_MS, MEAN_OUTPUT = 16, 25.0, 250
# The cost scenario: a rented GPU's price and the output tokens/s measured at a batch limit
PRICE_PER_HOUR, TOKENS_PER_S = 3.0, 1500.0


def saturation_answer(s: Setup) -> float:
    return slos.saturation_rate(ROWS, MEAN_OUTPUT, STEP_MS / 1e3)


def mean_output(s: Setup) -> float:
    """The run's requests' mean output tokens."""
    _, requests = batching.workload(s.cfg("continuous"))
    return sum(q.output_len for q in requests) / len(requests)


def tiny_napkin(r: Rows, s: Setup) -> float | None:
    """The formula at the run's rows, mean output and measured decode step."""
    step_ms = r.get("continuous", "decode_step_ms")
    return None if step_ms is None else slos.saturation_rate(s.cfg("continuous").batch_size,
                                                             mean_output(s), step_ms / 1e3)


def tiny_saturation(r: Rows, s: Setup) -> dict[str, str]:
    """The run's measured saturation beside the same formula at its measured step."""
    return {"measured": show(r.get("continuous", "saturation_requests_per_s"), "requests/s"),
            "napkin": show(tiny_napkin(r, s), "requests/s"),
            "step": show(r.get("continuous", "decode_step_ms"), "ms"),
            "rows": s.cfg("continuous").batch_size, "mean_out": show(mean_output(s)),
            "max_rate": show(r.get("continuous", "max_requests_per_s"), "requests/s")}


def saturation_supported(r: Rows, s: Setup) -> str | None:
    """The formula bounds the backlog replay: what it measured is at most the formula at its own
    measured step (10% for the median step against the mean)."""
    measured, napkin = r.get("continuous", "saturation_requests_per_s"), tiny_napkin(r, s)
    if measured is None or napkin is None:
        return "the run measured no saturation rate or decode step"
    return None if measured <= 1.1 * napkin else \
        f"the replay measured {show(measured, 'requests/s')}, above the formula's {show(napkin, 'requests/s')}"


def cost_supported(r: Rows, s: Setup) -> str | None:
    """The run's cost is the same formula at its price and its measured throughput."""
    tps, usd = r.get("continuous", "useful_tokens_per_s"), r.get("continuous", "usd_per_million_tokens")
    want = slos.usd_per_million_tokens(s.cfg("continuous").price_per_hour, tps) if tps else None
    return None if want and close(usd, want, 1e-9) else \
        f"the run's cost {show(usd, 'USD')} is not the formula's {show(want, 'USD')}"


def tiny_cost(r: Rows, s: Setup) -> dict[str, str]:
    cfg = s.cfg("continuous")
    return {"price": show(cfg.price_per_hour), "tiny_tps": show(r.get("continuous", "useful_tokens_per_s"), "tokens/s"),
            "tiny_cost": show(r.get("continuous", "usd_per_million_tokens"), "USD")}


def build_exercises() -> list[Exercise]:
    topic = TOPICS[5]  # inference
    return [
        Exercise(
            "sla_saturation", topic, "sla",
            answer=saturation_answer, evidence=tiny_saturation,
            level=1, mistake=lambda s: slos.saturation_rate(1, MEAN_OUTPUT, STEP_MS / 1e3),
            supports=saturation_supported, unit="requests/s", rel_tol=0.02,
            words={"server_rows": ROWS, "server_step_ms": STEP_MS, "server_mean_output": MEAN_OUTPUT,
                   "server_step_s": STEP_MS / 1e3}),
        Exercise(
            "sla_cost", topic, "sla",
            answer=lambda s: slos.usd_per_million_tokens(PRICE_PER_HOUR, TOKENS_PER_S),
            evidence=tiny_cost,
            level=1, mistake=lambda s: PRICE_PER_HOUR / TOKENS_PER_S * 1e6,
            supports=cost_supported, unit="USD", rel_tol=0.02,
            words={"price_per_hour": PRICE_PER_HOUR, "tokens_per_s": TOKENS_PER_S}),
    ]
