"""Batching: one workload of requests served by five schedulers over the same model.

- `sequential` (the reference): one request at a time, first come, first served.
- `static`: the next `batch_size` requests in arrival order start together once all have arrived,
  prompts padded to the longest, and hold their slots until the longest output is done.
- `dynamic`: the same per prompt-length bucket (`bucket_width`), a bucket starting when full or
  when its oldest request has waited `batch_timeout_ms`: less padding, shorter waits.
- `continuous`: iteration-level scheduling (Orca, vLLM) with the paged cache: a finished
  sequence's slot is refilled at the next step, blocks are taken as sequences grow, and when the
  pool runs dry the latest arrival is preempted.
- `priority`: continuous, but the queue is ordered by class (the workload's first class is the
  most urgent) and a waiting request preempts lower-class work to make room.

Two knobs of the paging schedulers (`continuous`, `priority`), vLLM's: `prefix_cache` reuses the
cached KV blocks a prompt starts with (the `shared_prefix` workload: requests share system prompts)
and `prefill_chunk` prefills a long prompt a chunk per iteration between the others' decode steps
(`long_prompts`). The reference and the reserving schedulers accept both and ignore them (the
`prefill_tokens` row says so). `prefill_tokens` counts the positions prefill computed;
`shared_prefix_fraction`, from the workload's tokens alone, is the share of prompt tokens in full
blocks of a prefix an earlier request holds (what the cache can save); `prefix_hit_rate` the share
of the full prompt blocks looked up that were reused.

Memory pressure is real: the KV pool holds `kv_budget_tokens` positions (allocated on the
device; on the CPU a budget far below the machine's memory). Reserving schedulers (`static`,
`dynamic`) take the longest possible sequence per request, so the budget caps their batch at
kv_budget_tokens // (longest prompt + longest output); paging ones take what they use.

Each variant replays the workload in real time (requests arrive at their times; `arrival=closed`
queues them all at t = 0). The check replays it with every request's continuation forced, so every
scheduler computes the same contexts: each token's log-probability must match the one-at-a-time
reference's, whatever the batch, padding or preemption around it. The engine is
`labkit.blocks.serving`, the workloads `labkit.blocks.requests`; the knobs (`Config`), the engine
and policy per scheduler, what a replay measured, the check and the napkin math are
`labkit.blocks.replay`'s, shared with the sla experiment.
"""
from __future__ import annotations

import dataclasses

import torch

from labkit.blocks.decoding import load_model
from labkit.blocks.replay import (REFERENCE_SCHEDULER, SCHEDULERS, ServingConfig, compare_replays,
                                  expected_replay, make_engine, num_slots, pages, policy,
                                  predicted_prefill, summary, texts, validate_replay, workload)
from labkit.blocks.replay import (WORKLOADS_DIR, longest, predicted_steps, prefill_rows,  # noqa: F401
                                  prefix_savings, prompts_of, quantile, shared_prefix_fraction,
                                  workload_spec)  # re-exported: their old home, used by callers
from labkit.blocks.serving import Engine
from labkit.workload import Workload

VARIANTS = SCHEDULERS
REFERENCE = REFERENCE_SCHEDULER
# smaller sizes of the default CPU run, cheapest last (labkit.harness.budget)
CPU_RUNGS = ({"num_requests": 16}, {"num_requests": 8, "max_output_len": 16},
             {"num_requests": 4, "max_output_len": 8, "num_layers": 2})

# a CPU-sized workload; the KV budget holds 5 reserved rows (576 // its longest 104) of 8
SIZES = {"tiny": {"batch_size": 8, "workload": "short", "kv_budget_tokens": 576}}

Config = ServingConfig
validate = validate_replay
compare = compare_replays  # each forced token's log-probability as the sequential reference's
expected = expected_replay


# --- building and replaying ------------------------------------------------------------------------

def build(cfg: Config) -> Workload:
    classes, requests = workload(cfg)
    model, tokens = load_model(cfg), texts(cfg, requests)
    closed = cfg.arrival == "closed"
    replays: list[Engine] = []

    def serve(forced: bool, closed: bool) -> Engine:
        eng = make_engine(cfg, model, requests, tokens, forced=forced, closed=closed)
        return eng.serve(policy(cfg, classes, num_slots(cfg, requests)))

    def step() -> None:
        replays.append(serve(False, closed))

    def check() -> dict:
        eng = serve(True, True)  # all queued at once: the fullest batches, the most preemption
        return {"logprobs": {s.req.id: torch.tensor(s.logprobs) for s in eng.seqs},
                "top1": {s.req.id: torch.tensor(s.top1) for s in eng.seqs},
                "served": sum(len(s.out) == s.req.output_len for s in eng.seqs)}

    def report() -> dict[str, float]:
        """The timed replay with the median throughput. The first replay is left out: it ran
        under the memory meter, whose tensor tracking slows a CPU run."""
        ranked = sorted((summary(e, cfg, classes) for e in replays[1:]),
                        key=lambda m: m["useful_tokens_per_s"])
        return ranked[len(ranked) // 2]

    return Workload(step=step, check=check, report=report, count_flops=False, min_repeats=1,
                    tensors={"kv_bytes": lambda: replays[-1].pool.tensors()},
                    notes=notes(cfg), compute_dtype=cfg.dtype,
                    energy_tokens=sum(r.output_len for r in requests))


def notes(cfg: Config) -> dict[str, str]:
    bound = "exact" if cfg.variant in ("sequential", "static") else "a lower bound (every step full)"
    return {"useful_tokens_per_s": "output tokens of every request (padding and recomputation "
                                   "excluded) over the time from the start to the last token; "
                                   "predicted: an upper bound, the fewest decode steps each at "
                                   "decode_step_ms's bound (prefill, host work and waiting left "
                                   "out). Where the gap goes: decode_step_ms against its bound, "
                                   "and the replay's decode, prefill, host and idle time_pct.",
            "decode_step_ms": "the median decode pass; predicted: a full batch reading each weight "
                              "once at the device's bandwidth (or its FLOPs at peak). A small "
                              "model's pass is longer: each of its few hundred operators has a "
                              "fixed host cost in eager PyTorch.",
            "host_time_pct": "of the replay: the engine's work between passes (scheduling, block "
                             "tables, slot indices); idle_time_pct: nothing to run, waiting for "
                             "an arrival or a timeout.",
            "decode_steps": f"predicted: {bound}.",
            "padding_waste_pct": "token positions computed for no request: prompt padding and the "
                                 "finished rows a batch carries until its longest is done.",
            "recomputed_pct": "positions prefilled again after a preemption.",
            "kv_bytes": "the KV pool: whole blocks of the budget (reservation: blocks of the "
                        "longest prompt + longest output).",
            "ttft_p99_ms": "arrival to first token; the replay with the median throughput.",
            "prefill_tokens": prefill_note(cfg),
            "shared_prefix_fraction": "from the workload's tokens alone: the share of prompt tokens "
                                      f"in full blocks of {cfg.block_size} of a prefix an earlier "
                                      "request holds (what a prefix cache can save).",
            "prefix_hit_rate": "reused blocks / full prompt blocks looked up (a prompt's last "
                               "position is always computed); predicted from the tokens alone."}


def prefill_note(cfg: Config) -> str:
    """What prefill_tokens counts, and which knobs this variant ignores."""
    note = ("positions computed by prefill passes, padding and recomputation included; predicted: "
            "the prompt tokens less what the prefix cache can reuse, no recomputation.")
    ignored = [f"prefix_cache={cfg.prefix_cache}".lower()] if cfg.prefix_cache else []
    ignored += [f"prefill_chunk={cfg.prefill_chunk}"] if cfg.prefill_chunk else []
    if ignored and not pages(cfg):
        why = ("the reference serves plainly (its log-probabilities are the check's)"
               if cfg.variant == REFERENCE else "it prefills padded batches into reserved memory")
        note += f" {' and '.join(ignored)} ignored by {cfg.variant}: {why}."
    return note


# --- for the notebook ------------------------------------------------------------------------------

def schedule_frames(cfg: Config):
    """One replay's schedule as two DataFrames: `segments` (request, priority, slot, start_ms,
    end_ms, state: served, held, preempted) for a Gantt chart, and `steps` (step, kind, start_ms,
    end_ms, live, rows, padding) for the slot occupancy."""
    import pandas as pd

    classes, requests = workload(cfg)
    eng = make_engine(cfg, load_model(cfg), requests, texts(cfg, requests), forced=False,
                      closed=cfg.arrival == "closed")
    eng.serve(policy(cfg, classes, num_slots(cfg, requests)))
    segments = pd.DataFrame([{**dataclasses.asdict(s), "start_ms": 1e3 * s.start_s,
                              "end_ms": 1e3 * s.end_s} for s in eng.segments])
    steps = pd.DataFrame([{"step": i, "kind": st.kind, "start_ms": 1e3 * st.start_s,
                           "end_ms": 1e3 * st.end_s, "live": st.live, "rows": st.rows,
                           "padding": st.padding} for i, st in enumerate(eng.steps)])
    return segments.drop(columns=["start_s", "end_s"]), steps


TRICK_METRICS = ("prefill_tokens", "prefix_hit_rate", "tpot_p50_ms", "tpot_p99_ms", "ttft_p50_ms",
                 "ttft_p99_ms", "makespan_ms", "preemptions")


def tricks_frame(cfg: Config, prefill_chunk: int = 32):
    """vLLM's two tricks, one replay of each setting on its workload (the rest of `cfg` as given,
    its variant continuous unless it is a paging one): `shared_prefix` without and with the prefix
    cache, `long_prompts` without and with chunks of `prefill_chunk`. A DataFrame: metrics as its
    index (TRICK_METRICS, then the predicted prefill tokens), one column per setting."""
    import pandas as pd

    cfg = cfg if pages(cfg) else dataclasses.replace(cfg, variant="continuous")
    settings = {"shared_prefix, no cache": ("shared_prefix", False, 0),
                "shared_prefix, prefix cache": ("shared_prefix", True, 0),
                "long_prompts, whole prompts": ("long_prompts", False, 0),
                f"long_prompts, chunks of {prefill_chunk}": ("long_prompts", False, prefill_chunk)}
    model, columns = load_model(cfg), {}
    for name, (load, cache, chunk) in settings.items():
        c = dataclasses.replace(cfg, workload=load, prefix_cache=cache, prefill_chunk=chunk)
        classes, requests = workload(c)
        eng = make_engine(c, model, requests, texts(c, requests), forced=False,
                          closed=c.arrival == "closed")
        measured = summary(eng.serve(policy(c, classes, num_slots(c, requests))), c, classes)
        columns[name] = {**{m: measured.get(m) for m in TRICK_METRICS},
                         "predicted_prefill_tokens": predicted_prefill(c, requests)["prefill_tokens"]}
    return pd.DataFrame(columns).rename_axis("metric")
