"""The serving engine's prefix cache and chunked prefill: block hashes, reference counts and LRU
eviction, prefill tokens against the formula, unchanged log-probabilities, the shared-prefix
fraction, the workloads (old files still load) and the variants that ignore both knobs."""
import dataclasses

import pytest
import torch

from labkit.blocks.requests import SHIPPED, load_workload, make_requests
from labkit.blocks.serving import PrefixCachingPool, block_hashes, reusable_blocks
from labkit.config import resolve
from labkit.techniques import batching
from labkit.techniques.kv_cache import load_model

# 8 requests of the shared_prefix workload (3 system prompts of 64 tokens), outputs clipped to 6,
# all queued at t = 0, one layer; a pool that never runs out (no preemption, no eviction).
SIZES = {"workload": "shared_prefix", "num_requests": 8, "max_output_len": 6, "arrival": "closed",
         "batch_size": 4, "kv_budget_tokens": 2048, "block_size": 16, "num_layers": 1}


def config(**overrides):
    return resolve(batching.Config, "tiny", {**SIZES, "device": "cpu", **overrides},
                   experiment="batching")


def replay(cfg, forced=True):
    classes, requests = batching.workload(cfg)
    eng = batching.make_engine(cfg, load_model(cfg), requests, batching.texts(cfg, requests),
                               forced=forced, closed=True)
    return eng.serve(batching.policy(cfg, classes, batching.num_slots(cfg, requests)))


def pool(num_blocks=4, block_size=2):
    return PrefixCachingPool(num_layers=1, num_blocks=num_blocks, block_size=block_size, kv_heads=1,
                             head_dim=2, dtype=torch.float32, device="cpu")


def test_a_block_hash_covers_its_tokens_and_everything_before_it():
    a = block_hashes([1, 2, 3, 4, 5], 2)
    assert len(a) == 2  # the partial block [5] is not hashed
    assert block_hashes([1, 2, 3, 4, 9], 2) == a
    assert block_hashes([7, 2, 3, 4], 2)[1] != a[1]  # same block, another prefix: another hash
    assert block_hashes([1, 2, 3, 5], 2)[0] == a[0] != block_hashes([1, 2, 3, 5], 2)[1]
    assert reusable_blocks([1, 2, 3, 4], 2) == 1  # the last position is always computed


def test_shared_blocks_are_counted_and_cached_ones_evicted_least_recent_first():
    p = pool()
    p.allocate(0, 4)
    p.commit(0, [1, 2, 3, 4], 4)
    first = p.block_table(0)
    assert p.share_prefix(1, [1, 2, 3, 4, 5]) == 2  # both full blocks reused, nothing computed
    p.allocate(1, 5)
    assert p.block_table(1)[:2] == first and [p.refs[b] for b in first] == [2, 2]
    assert p.num_free_blocks == 1
    p.free(0)
    assert [p.refs[b] for b in first] == [1, 1] and not p.evictable  # seq 1 still holds them
    p.free(1)
    assert list(p.evictable) == first[::-1] and p.num_free_blocks == 4  # cached, yet free
    p.allocate(2, 6)  # the 2 unhashed blocks first, then the least recently freed: the tail one
    assert p.num_evicted == 1 and p.lookup([1, 2, 3, 4, 5]) == first[:1]
    with pytest.raises(MemoryError):
        p.allocate(3, 4)  # 2 blocks, 1 free: blocks in use are never evicted


def test_a_duplicate_computed_at_the_same_time_stays_private():
    p = pool()
    for seq in (0, 1):
        p.allocate(seq, 2)
    p.commit(0, [1, 2], 2)
    p.commit(1, [1, 2], 2)
    assert p.cached == {block_hashes([1, 2], 2)[0]: p.block_table(0)[0]}
    p.free(1)
    assert not p.evictable and p.num_free_blocks == 3


def test_the_shared_prefix_fraction_counts_full_blocks_an_earlier_prompt_holds():
    prompts = [[1, 2, 3, 4, 5], [1, 2, 3, 4, 6, 7], [1, 2, 9, 9], [1, 2, 3, 4]]
    # block 2: 0, 2 ([1,2],[3,4]), 1 ([1,2]), 1 ([1,2]: [3,4] is its last, always computed)
    assert batching.prefix_savings(prompts, 2) == (4, 2 + 2 + 1 + 1)
    assert batching.shared_prefix_fraction(prompts, 2) == pytest.approx(4 * 2 / 19)


def test_prefill_tokens_are_the_prompts_less_the_cached_blocks():
    cfg = config(variant="continuous", prefix_cache=True)
    eng = replay(cfg)
    rows = batching.prefill_rows(eng, cfg)
    _, requests = batching.workload(cfg)
    reused, looked_up = batching.prefix_savings(batching.prompts_of(cfg, requests), 16)
    assert reused > 0 and sum(s.preemptions for s in eng.seqs) == 0
    assert rows["prefill_tokens"] == sum(r.prompt_len for r in requests) - 16 * reused
    assert rows["prefix_hit_rate"] == reused / looked_up
    assert batching.expected(cfg)["prefill_tokens"] == rows["prefill_tokens"]
    assert sum(st.reused for st in eng.steps) == 16 * reused
    assert rows["shared_prefix_fraction"] > 0.2  # the workload's own property


@pytest.mark.parametrize("overrides", [
    {"variant": "continuous", "prefix_cache": True},
    {"variant": "continuous", "prefill_chunk": 24},
    # a pool that runs dry: cached blocks evicted, a sequence preempted and resumed
    {"variant": "priority", "prefix_cache": True, "prefill_chunk": 8, "kv_budget_tokens": 192},
])
def test_the_cache_and_chunks_leave_every_log_probability_unchanged(overrides):
    plain = replay(config(variant="continuous"))
    eng = replay(config(**overrides))
    assert all(len(s.logprobs) == s.req.output_len for s in eng.seqs)
    for a, b in zip(plain.seqs, eng.seqs):
        torch.testing.assert_close(torch.tensor(b.logprobs), torch.tensor(a.logprobs),
                                   rtol=0, atol=1e-4)
    if overrides.get("prefill_chunk"):
        chunk = overrides["prefill_chunk"]
        assert max(st.positions for st in eng.steps if st.kind == "prefill") <= chunk
    if overrides.get("kv_budget_tokens"):
        assert sum(s.preemptions for s in eng.seqs) > 0 and eng.pool.num_evicted > 0


def test_a_chunked_prompt_lets_the_others_decode_between_its_chunks():
    eng = replay(config(variant="continuous", prefill_chunk=16, num_requests=6))
    kinds = "".join(st.kind[0] for st in eng.steps)  # p: prefill, d: decode
    assert "pdp" in kinds  # a decode step between two prefill passes
    long = max(eng.seqs, key=lambda s: s.req.prompt_len)
    assert long.first_step > len(long.prompt) // 16  # one chunk per iteration


def test_saved_workloads_still_load_and_shared_prefixes_share_tokens():
    for name, spec in SHIPPED.items():
        loaded, requests = load_workload(batching.WORKLOADS_DIR / f"{name}.json")
        assert loaded == spec and requests == make_requests(spec)
    _, default = load_workload(batching.WORKLOADS_DIR / "default.json")
    assert all(r.prefix_id == -1 and r.prefix_len == 0 for r in default)
    cfg = config(num_requests=0)
    _, requests = batching.workload(cfg)
    tokens = batching.texts(cfg, requests)
    first = {}
    for r, t in zip(requests, tokens):
        head = first.setdefault(r.prefix_id, t[:64])
        assert torch.equal(t[:64], head) and r.prompt_len > 64
    assert len(first) == 3 and not torch.equal(first[0], first[1])
    long = [r.prompt_len for r in batching.workload(config(workload="long_prompts"))[1]]
    assert max(long) >= 192 and min(long) <= 32


@pytest.mark.parametrize("variant", ["sequential", "static", "dynamic"])
def test_schedulers_that_do_not_page_ignore_both_knobs_and_say_so(variant):
    cfg = config(variant=variant, prefix_cache=True, prefill_chunk=8, num_requests=3)
    _, requests = batching.workload(cfg)
    eng = batching.make_engine(cfg, load_model(cfg), requests, batching.texts(cfg, requests),
                               forced=False, closed=True)
    assert not eng.prefix_cache and eng.prefill_chunk == 0
    note = batching.notes(cfg)["prefill_tokens"]
    assert f"prefix_cache=true and prefill_chunk=8 ignored by {variant}" in note
    assert "ignored" not in batching.notes(dataclasses.replace(cfg, variant="continuous"))["prefill_tokens"]
    assert "prefix_hit_rate" not in batching.expected(cfg)


@pytest.mark.slow
def test_the_prefix_exercises_grade_the_formula_against_the_replay(tmp_path):
    from labkit.study.exercises import serving
    from labkit.study.exercises.core import Setup, grade, measure
    from labkit.study.exercises.runs import RUNS

    exercises = {ex.key: ex for ex in serving.build_exercises()}
    assert set(exercises) == {"prefix_prefill_tokens", "prefix_hit_rate"}
    setup = Setup(RUNS["serve_prefix"], "cpu")
    rows = measure(RUNS["serve_prefix"], "cpu", str(tmp_path))
    # computed here from the requests alone: a prompt of n tokens looks up (n - 1) // 16 full
    # blocks; the first request of a system prompt finds none cached, every later one finds the
    # system prompt's full blocks (its own tokens after them match nothing)
    cfg, requests = serving.requests_of(setup)
    bs, seen, reused, looked_up = cfg.block_size, set(), 0, 0
    for r in requests:
        looked_up += (r.prompt_len - 1) // bs
        reused += min(r.prefix_len // bs, (r.prompt_len - 1) // bs) if r.prefix_id in seen else 0
        seen.add(r.prefix_id)
    total = sum(r.prompt_len for r in requests)
    assert 0 < reused < looked_up
    careful = {"prefix_prefill_tokens": total - reused * bs, "prefix_hit_rate": reused / looked_up}
    mistakes = {"prefix_prefill_tokens": total - sum(r.prefix_len for r in requests),
                "prefix_hit_rate": reused / sum(-(-r.prompt_len // bs) for r in requests)}
    for key, ex in exercises.items():
        answer = ex.answer(setup)
        assert grade(ex, careful[key], answer), (key, careful[key], answer)
        assert ex.mistake(setup) == pytest.approx(mistakes[key], rel=1e-12)
        off = careful[key] + 2 * ex.tolerance(careful[key]) + (0 if ex.abs_tol else 1)
        assert not grade(ex, mistakes[key], answer) and not grade(ex, off, answer), key
        assert ex.supports(rows, setup) is None, ex.key  # the replay measured the formula
        assert "system prompt" in ex.details(setup)
        ex.why.format(**ex.evidence(rows, setup), answer=answer, prediction=answer)
    fraction = rows.get("continuous", "shared_prefix_fraction")
    total = sum(r.prompt_len for r in serving.requests_of(setup)[1])
    assert exercises["prefix_prefill_tokens"].answer(setup) == pytest.approx(total * (1 - fraction))
