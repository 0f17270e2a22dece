"""batching: rows of different lengths in one forward pass, the serving engine's schedules and
memory, each scheduler against the one-at-a-time reference, and the config's refusals."""
import pytest
import torch

from labkit.config import MODELS, ConfigError, resolve
from labkit.harness.experiment import run_experiment
from labkit.blocks.model import build_model
from labkit.techniques import batching
from labkit.techniques.kv_cache import load_model
from labkit.blocks.kv_caches import BlockPool, DynamicCache
from labkit.blocks.requests import Request
from labkit.blocks.serving import RowCache
from labkit.views.plots import schedule_figure

pytestmark = pytest.mark.slow  # this module's fixtures measure for seconds

# A backlog (all queued at t = 0: no timing in the schedule) of the default workload's first 12
# requests, outputs clipped to 32 tokens; 4 rows; a pool of 192 positions: static reserves the
# longest prompt + longest output (30 + 32) per request (3 fit), continuous pages 8 at a time and
# runs out (preemption). One layer: the schedule is the same on any depth.
SIZES = {"workload": "default", "num_requests": 12, "max_output_len": 32, "arrival": "closed",
         "batch_size": 4, "kv_budget_tokens": 192, "block_size": 8, "num_layers": 1}


def config(**overrides):
    return resolve(batching.Config, "tiny", {**SIZES, "device": "cpu", **overrides},
                   experiment="batching")


@pytest.fixture(scope="module")
def frame(tmp_path_factory):
    result = run_experiment("batching", preset="tiny", overrides=SIZES, progress=False,
                            runs_dir=str(tmp_path_factory.mktemp("runs")))
    return result.frame()


def value(frame, variant, metric, column="value"):
    rows = frame[(frame.variant == variant) & (frame.metric == metric)]
    assert len(rows) == 1, (variant, metric)
    return rows[column].iloc[0]


def test_rows_of_different_lengths_in_one_pass_match_each_row_alone():
    """Per-row positions: right-padded prefill (logits at each row's last real token), then a
    decode step where each row reads its own slots, equal to every row run by itself."""
    torch.manual_seed(0)
    model = build_model(MODELS["tiny"], seed=0).eval()
    m = model.cfg
    lengths = [5, 9, 3]
    prompts = [torch.randint(0, m.vocab_size, (n,)) for n in lengths]
    pool = BlockPool(num_layers=m.num_layers, num_blocks=12, block_size=4, kv_heads=m.num_kv_heads,
                     head_dim=m.head_dim, dtype=torch.float32, device="cpu")
    width = max(lengths)
    for seq, n in enumerate(lengths):
        pool.allocate(seq, n + 1)
    slots = torch.stack([torch.cat([pool.slots(s, 0, n), pool.slots(s, n, n + 1).expand(width - n)])
                         for s, n in enumerate(lengths)])
    tokens = torch.stack([torch.cat([p, torch.zeros(width - len(p), dtype=torch.long)]) for p in prompts])
    with torch.inference_mode():
        first = model(tokens, start_pos=torch.zeros(3, dtype=torch.long), cache=RowCache(pool, slots, slots),
                      last_only=torch.tensor(lengths) - 1)[:, -1]
        nxt = first.argmax(-1)
        write = torch.stack([pool.slots(s, n, n + 1) for s, n in enumerate(lengths)])
        read = torch.stack([torch.cat([pool.slots(s, 0, n + 1), pool.slots(s, n, n + 1).expand(width - n)])
                            for s, n in enumerate(lengths)])
        second = model(nxt[:, None], start_pos=torch.tensor(lengths), cache=RowCache(pool, write, read),
                       last_only=True)[:, -1]
        for row, prompt in enumerate(prompts):
            cache = DynamicCache(m.num_layers)
            alone = model(prompt[None], cache=cache, last_only=True)[0, -1]
            torch.testing.assert_close(first[row], alone, rtol=1e-4, atol=1e-4)
            alone = model(nxt[row].view(1, 1), start_pos=len(prompt), cache=cache)[0, -1]
            torch.testing.assert_close(second[row], alone, rtol=1e-4, atol=1e-4)


def test_every_scheduler_computes_the_reference_log_probabilities(frame):
    bad = frame[(frame.status != "ok") & (frame.metric != "joules_per_token")]  # energy: where readable
    assert bad.empty, bad[["variant", "status", "message"]].to_string()
    for variant in batching.VARIANTS:
        assert value(frame, variant, "logprob_max_abs_diff") <= 1e-3
        assert value(frame, variant, "token_agreement") == 1.0


def test_static_decodes_as_its_napkin_math_says_and_continuous_in_fewer_steps(frame):
    """Static batches are consecutive groups in arrival order, whatever the timing: its decode
    steps and padding are predicted exactly. Continuous refills slots, so it needs fewer steps."""
    for metric in ("decode_steps", "padding_waste_pct", "max_concurrent"):
        assert value(frame, "static", metric) == pytest.approx(value(frame, "static", metric, "predicted"))
    assert value(frame, "static", "max_concurrent") == 3  # 192 // (30 + 32): the budget, not the rows
    assert value(frame, "static", "padding_waste_pct") > 10
    sequential = value(frame, "sequential", "decode_steps")
    assert sequential == value(frame, "sequential", "decode_steps", "predicted")
    steps, bound = (value(frame, "continuous", "decode_steps", c) for c in ("value", "predicted"))
    assert bound <= steps < value(frame, "static", "decode_steps")
    assert value(frame, "continuous", "padding_waste_pct") == 0.0


def test_a_full_pool_preempts_and_the_recomputed_work_is_counted(frame):
    assert value(frame, "continuous", "preemptions") > 0
    assert value(frame, "continuous", "recomputed_pct") > 0
    assert value(frame, "static", "preemptions") == 0  # reservation never runs out
    per_token = 2 * SIZES["num_layers"] * 2 * 64 * 4  # K and V x layers x kv heads x head_dim x fp32
    assert value(frame, "continuous", "kv_bytes") == 192 * per_token
    _, requests = batching.workload(config())
    assert batching.longest(requests) == 62
    assert value(frame, "static", "kv_bytes") == 3 * 62 * per_token


def first_steps(variant: str) -> dict[str, list[int]]:
    """Per class, the index of the pass that gave each request its first token (one replay)."""
    cfg = config(variant=variant)
    classes, requests = batching.workload(cfg)
    eng = batching.make_engine(cfg, load_model(cfg), requests, batching.texts(cfg, requests),
                               forced=False, closed=True)
    eng.serve(batching.policy(cfg, classes, batching.num_slots(cfg, requests)))
    return {c: [s.first_step for s in eng.seqs if s.req.priority == c] for c in classes}


def test_priority_serves_the_urgent_class_first():
    """The same backlog, ordered by the step each first token came in (not the clock): first come
    first served (continuous) makes late high-priority requests wait for the low ones ahead of
    them; priority gives every high request its first token before any low one."""
    fcfs, priority = first_steps("continuous"), first_steps("priority")
    assert max(fcfs["high"]) > min(fcfs["low"])  # request 3 (high) queues behind 0..2 (low)
    assert max(priority["high"]) < min(priority["low"])


def test_the_schedule_frames_show_who_held_which_slot():
    cfg = config(variant="static", num_requests=8, max_output_len=16)
    segments, steps = batching.schedule_frames(cfg)
    served = segments[segments.state == "served"]
    assert sorted(served.request) == list(range(8))
    _, requests = batching.workload(cfg)
    assert set(segments.slot) == set(range(batching.num_slots(cfg, requests)))
    assert set(segments.state) <= {"served", "held"}
    for _, slot in segments.groupby("slot"):  # one request at a time per slot
        slot = slot.sort_values("start_ms")
        assert (slot.start_ms.iloc[1:].values >= slot.end_ms.iloc[:-1].values - 1e-6).all()
    decode = steps[steps.kind == "decode"]
    assert (decode.rows - decode.live == decode.padding).all()
    fig = schedule_figure(segments, steps)
    assert {t.name for t in fig.data} >= {"high: served", "low: served", "rows computed"}


@pytest.mark.parametrize("overrides, message", [
    ({"workload": "nope"}, "unknown workload 'nope'; valid: default, long_prompts, shared_prefix, short"),
    ({"kv_budget_tokens": 40}, "cannot hold one request"),
    ({"variant": "fifo"}, "valid: sequential, static, dynamic, continuous, priority"),
])
def test_bad_settings_are_refused_by_name(overrides, message):
    with pytest.raises(ConfigError, match=message):
        batching.validate(config(**overrides))


def test_the_output_clip_and_request_count_apply_to_the_saved_workload():
    classes, requests = batching.workload(config(num_requests=5, max_output_len=20))
    assert classes == ("high", "low") and len(requests) == 5
    assert all(isinstance(r, Request) and r.output_len <= 20 for r in requests)
    longest = max(r.prompt_len for r in requests) + max(r.output_len for r in requests)
    assert batching.longest(requests) == longest
