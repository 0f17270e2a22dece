"""Exercises on serving under an SLO (`labkit.techniques.sla`): the saturation rate from slots,
output length and step time, and the cost per million tokens from a price and a throughput.

Both are predicted from their formulas (`labkit.blocks.slo`) on the numbers their scenarios state,
then shown beside the tiny run (`RUNS["sla"]` in `labkit.study.exercises.runs`), where the same
formulas meet the measured step and throughput.
"""
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
            "sla_saturation", topic, "The request rate a server saturates at",
            f"A server decodes with continuous batching on {ROWS} rows; a full decode step takes "
            f"{STEP_MS:g} ms and advances every row by one token. Requests average {MEAN_OUTPUT} "
            "output tokens. Leave prefill, host work and waiting out.",
            "At what request rate (requests/s) does it saturate: the most requests per second it "
            "can finish?", "sla",
            answer=saturation_answer, evidence=tiny_saturation,
            why=(f"each of the {ROWS} rows finishes a request every {MEAN_OUTPUT} steps of "
                 f"{STEP_MS:g} ms: {ROWS} / ({MEAN_OUTPUT} x {STEP_MS / 1e3:g} s) = {{answer}}. The "
                 "tiny run: {rows} rows, {mean_out} output tokens on average, a measured step of "
                 "{step}: the formula says {napkin}, the backlog replay measured {measured} "
                 "(prefill and host work are not free), and the SLO search found {max_rate}: "
                 "queueing misses the SLO before the server saturates."),
            level=1, hint="Each row finishes one request every (mean output) steps; the server has "
                          "`rows` of them, and a step takes the step time.",
            mistake=lambda s: slos.saturation_rate(1, MEAN_OUTPUT, STEP_MS / 1e3),
            mistake_why="that serves one request at a time; all the rows decode in the same step.",
            supports=saturation_supported, unit="requests/s", rel_tol=0.02),
        Exercise(
            "sla_cost", topic, "Cost per million tokens",
            f"A GPU rents at {PRICE_PER_HOUR:.2f} USD per hour. At the batch limit you chose it "
            f"produces {TOKENS_PER_S:,.0f} output tokens per second, around the clock.",
            "What does one million output tokens cost, in USD?", "sla",
            answer=lambda s: slos.usd_per_million_tokens(PRICE_PER_HOUR, TOKENS_PER_S),
            evidence=tiny_cost,
            why=f"{PRICE_PER_HOUR:g} USD per hour is {PRICE_PER_HOUR:g} / 3600 USD per second; a "
                f"million tokens take 1e6 / {TOKENS_PER_S:g} s; the product is {{answer}} USD. The "
                "tiny run, priced at {price} USD per device-hour, measured {tiny_tps}: {tiny_cost} "
                "per million tokens. A larger batch raises tokens/s per device and so cuts the cost; "
                "each user's tokens/s falls: the Pareto figure's trade-off.",
            level=1, hint="Turn the price into USD per second, the throughput into seconds per "
                          "million tokens, and multiply.",
            mistake=lambda s: PRICE_PER_HOUR / TOKENS_PER_S * 1e6,
            mistake_why="that treats the hourly price as a price per second; divide by 3600 first.",
            supports=cost_supported, unit="USD", rel_tol=0.02),
    ]
