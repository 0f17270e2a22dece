"""The serving engine on known inputs: the pool's slot mapping, RowCache's reads and writes, and
the Engine's schedules (decode steps, padding, preemption, priority) on a two-layer model, whose
tokens must be plain greedy decoding's."""
import dataclasses

import pytest
import torch

from labkit.config import MODELS
from labkit.blocks.model import build_model
from labkit.blocks.kv_caches import BlockPool, DynamicCache
from labkit.blocks.requests import Request
from labkit.blocks.serving import BatchPolicy, Engine, IterationPolicy, RowCache, Sequence

CFG = dataclasses.replace(MODELS["tiny"], num_layers=2)


@pytest.fixture(scope="module")
def model():
    return build_model(CFG, seed=0).eval()


def pool(num_blocks: int, block_size: int, num_layers: int = CFG.num_layers) -> BlockPool:
    return BlockPool(num_layers=num_layers, num_blocks=num_blocks, block_size=block_size,
                     kv_heads=CFG.num_kv_heads, head_dim=CFG.head_dim, dtype=torch.float32, device="cpu")


def seqs(shapes: list[tuple[int, int]], priorities: str = "") -> list[Sequence]:
    """Requests of (prompt_len, output_len), all queued at t = 0, with seeded prompts."""
    gen = torch.Generator().manual_seed(1)
    out = []
    for i, (prompt, output) in enumerate(shapes):
        priority = {"h": "high", "l": "low"}[priorities[i]] if priorities else "low"
        req = Request(id=i, arrival_s=0.0, prompt_len=prompt, output_len=output, priority=priority)
        out.append(Sequence(req=req, prompt=torch.randint(0, CFG.vocab_size, (prompt,), generator=gen).tolist()))
    return out


def engine(model, sequences, *, slots: int, blocks: int, block_size: int, reserve: int = 0) -> Engine:
    return Engine(model, sequences, num_slots=slots, num_blocks=blocks, block_size=block_size,
                  reserve=reserve, kv_dtype=torch.float32, closed=True)


@torch.inference_mode()
def greedy(model, prompt: list[int], n: int) -> list[int]:
    """Plain greedy decoding, one sequence, a DynamicCache."""
    cache = DynamicCache(CFG.num_layers)
    logits = model(torch.tensor([prompt]), cache=cache, last_only=True)
    out = [logits[0, -1].argmax().item()]
    while len(out) < n:
        logits = model(torch.tensor([[out[-1]]]), start_pos=len(prompt) + len(out) - 1, cache=cache)
        out.append(logits[0, -1].argmax().item())
    return out


def test_slot_mapping_follows_the_block_table_and_pads_with_the_last_slot():
    p = pool(num_blocks=6, block_size=4, num_layers=1)
    p.allocate(0, 6)  # blocks 0, 1
    p.allocate(1, 3)  # block 2
    p.allocate(0, 9)  # block 3: seq 0's third block is not next to its second
    assert p.block_table(0) == [0, 1, 3] and p.block_table(1) == [2]
    assert p.slots(0, 0, 9).tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 12]
    rows = p.padded_slots([0, 1], [8, 2], 10)  # positions 0..8 and 0..2, padded to 10
    assert rows.tolist() == [[0, 1, 2, 3, 4, 5, 6, 7, 12, 12], [8, 9, 10, 10, 10, 10, 10, 10, 10, 10]]
    p.free(0)
    assert p.num_free_blocks == 5 and p.block_table(0) == []


def test_row_cache_writes_each_rows_keys_at_its_slots_and_reads_them_back():
    p = pool(num_blocks=4, block_size=4, num_layers=2)
    p.allocate(0, 3)
    p.allocate(1, 2)
    read = p.padded_slots([0, 1], [2, 1], 3)  # (2, 3): row 1 padded with its position 1's slot
    write = read.gather(1, torch.tensor([[2], [1]]))  # each row's newest position
    assert read.tolist() == [[0, 1, 2], [4, 5, 5]] and write.tolist() == [[2], [5]]
    k = torch.randn(2, CFG.num_kv_heads, 1, CFG.head_dim)  # (B, KV, T, hd)
    v = torch.randn_like(k)
    k_all, v_all = RowCache(p, write, read).update(1, k, v)  # (B, KV, S, hd)
    assert k_all.shape == (2, CFG.num_kv_heads, 3, CFG.head_dim)
    torch.testing.assert_close(p.k[1, 2], k[0, :, 0])
    torch.testing.assert_close(p.v[1, 5], v[1, :, 0])
    torch.testing.assert_close(k_all[0, :, 2], k[0, :, 0])
    torch.testing.assert_close(k_all[1, :, 1], k[1, :, 0])
    torch.testing.assert_close(k_all[1, :, 2], k[1, :, 0])  # padding repeats the last slot
    assert p.k[0].abs().sum() == 0  # layer 0 untouched


def test_continuous_emits_plain_greedy_tokens_in_the_steps_its_schedule_takes(model):
    """Two rows, outputs 3, 5, 2: requests 0 and 1 decode together; when 0 is done (after decode
    step 2) request 2 takes its row; 1 ends at decode step 4. No padding anywhere."""
    sequences = seqs([(5, 3), (9, 5), (3, 2)])
    eng = engine(model, sequences, slots=2, blocks=16, block_size=4).serve(IterationPolicy())
    for s in sequences:
        assert s.out == greedy(model, s.prompt, s.req.output_len)
    kinds = [st.kind for st in eng.steps]
    assert kinds == ["prefill", "prefill", "decode", "decode", "prefill", "decode", "decode"]
    assert [s.first_step for s in sequences] == [0, 1, 4]
    assert sum(st.padding for st in eng.steps) == 0 and eng.pool.num_free_blocks == 16


def test_static_decodes_until_the_longest_and_counts_the_padding(model):
    """One batch of 3: prompts padded to 9 (3 * 9 - 17 padding positions), then 5 - 1 decode
    steps for the longest output, the finished rows carried along (padding)."""
    sequences = seqs([(5, 3), (9, 5), (3, 2)])
    eng = engine(model, sequences, slots=3, blocks=3, block_size=14, reserve=14)
    eng.serve(BatchPolicy(3))
    prefill, *decode = eng.steps
    assert (prefill.positions, prefill.padding) == (27, 27 - 17)
    assert len(decode) == 4 and [st.padding for st in decode] == [0, 1, 2, 2]
    for s in sequences:
        assert s.out == greedy(model, s.prompt, s.req.output_len)
    assert {seg.state for seg in eng.segments} == {"served", "held"}


def test_a_full_pool_preempts_the_latest_arrival_and_recomputes_it(model):
    """Blocks of 2, a pool of 16 positions, two sequences growing to 6 + 8 each (one fits, two do
    not): the pool runs dry, request 1 is preempted (recompute mode), resumed once request 0 is
    done with its prompt and tokens prefilled again, and still emits greedy decoding's tokens."""
    sequences = seqs([(6, 8), (6, 8)])
    eng = engine(model, sequences, slots=2, blocks=8, block_size=2).serve(IterationPolicy())
    assert [s.preemptions for s in sequences] == [0, 1]
    assert sum(st.recomputed for st in eng.steps) > 0
    assert "preempted" in {seg.state for seg in eng.segments if seg.request == 1}
    for s in sequences:
        assert s.out == greedy(model, s.prompt, s.req.output_len)


@pytest.mark.parametrize("ranks, preempted", [({"high": 0, "low": 1}, True), (None, False)])
@torch.inference_mode()  # as Engine.serve runs
def test_a_waiting_urgent_request_preempts_lower_class_work_only_under_priority(model, ranks, preempted):
    low, high = seqs([(4, 6), (4, 6)], priorities="lh")
    eng = engine(model, [low, high], slots=1, blocks=8, block_size=4)
    policy = IterationPolicy(ranks)
    eng.waiting = [low]
    assert policy.admit(eng, more_coming=True) == [low]
    eng.prefill([low])
    eng.waiting.append(high)
    started = policy.admit(eng, more_coming=False)
    assert (started == [high]) == preempted
    assert (low in eng.waiting and low.preemptions == 1) == preempted
    assert eng.running == ([high] if preempted else [low])
