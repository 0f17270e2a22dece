"""The figures of the context-parallel (cp-), mixture-of-experts (moe-) and gradient-compression
(gc-) questions, each computed by labkit's planner at the settings its stem states."""
import dataclasses

import pytest

from labkit import planner
from labkit.config import MODELS
from labkit.study.quiz import load_bank

MIB, GIB = 2**20, 2**30


@pytest.fixture(scope="module")
def text():
    return {q.id: q.question + " " + q.explanation + " " + " ".join(q.choices) for q in load_bank()}


def has(text: str, *figures: str) -> None:
    for figure in figures:
        assert figure in text, figure


def test_ring_attention_bytes_and_activations(text):
    ring = dict(batch=1, kv_heads=8, seq_len=32768, head_dim=128, n=4)
    has(text["cp-01"], f"= {planner.cp_block_bytes(1, 8, 32768, 128, 4) // MIB} MiB",
        f"= {planner.ring_sends(4)} blocks", f"{planner.ring_sent_bytes(**ring) // MIB} MiB",
        f"{planner.ring_sent_bytes(**ring, backward=False) // MIB} MiB")
    shard = [planner.cp_block_bytes(1, 32, 16384 * n, 128, n, e=2) for n in (2, 4, 8)]
    ulysses = [planner.ulysses_all_to_all_bytes(1, 32, 8, 16384 * n, 128, n, e=2) for n in (2, 4, 8)]
    assert len(set(shard)) == len(set(ulysses)) == 1  # constant as S and n grow together
    rings = [planner.ring_sent_bytes(batch=1, kv_heads=8, seq_len=16384 * n, head_dim=128, n=n, e=2)
             for n in (2, 4, 8)]
    has(text["cp-02"], f"{shard[0] // MIB} MiB", f"{ulysses[0] // MIB} MiB",
        ", ".join(f"{b // MIB:,}" for b in rings[:2]) + f" and {rings[2] // MIB:,} MiB")
    per_rank, whole = (planner.cp_activation_bytes(1, 32, 8, 131072, 128, n, e=2) for n in (8, 1))
    has(text["cp-03"], f"{per_rank / MIB:.0f} MiB", f"{whole / GIB:.2f} GiB")


def test_causal_pairs_per_rank(text):
    contiguous, zigzag = planner.causal_pairs(8192, 4), planner.causal_pairs(8192, 4, "zigzag")
    has(text["cp-04"], f"{contiguous[0]:,} pairs on rank 0", f"{contiguous[-1]:,} on rank 3",
        f"{zigzag[0]:,} pairs on every rank", f"{planner.causal_imbalance(8192, 4):.2f} times")
    assert len(set(zigzag)) == 1


def test_mixtral_counts_routing_and_expert_parallel_memory(text):
    m = planner.MIXTRAL_8X7B
    total, experts, active = planner.num_params(m), planner.expert_params(m), planner.active_params(m)
    has(text["moe-01"], f"{total:,}", f"{experts:,}", f"{active:,}", f"about {active / total:.0%}")
    capacity = planner.capacity(64, 2, 4, 1.0)
    dropped = planner.dropped_assignments([48, 40, 24, 16], capacity)
    has(text["moe-02"], f"C = ceil(1.0 × 128 / 4) = {capacity}", f"{dropped} dropped",
        f"{dropped / 128:.0%} of the assignments")
    assert planner.load_balancing_loss([1, 1, 1, 1], [0.25] * 4, 2) == 2.0  # "exactly k"
    layer = planner.uniform_offrank_bytes(dataclasses.replace(m, num_layers=1), 4096, 8, dtype_bytes=2)
    has(text["moe-04"], f"{layer / 2 / MIB:.0f} MiB in all", f"{layer / 4 / MIB:.0f} MiB for the dispatch")
    ep = planner.ep_memory(m, 8, "bf16_weights", "adamw")
    has(text["moe-06"], f"{ep['expert_params']:,} expert parameters",
        f"{ep['replicated_params']:,} replicated", f"{ep['params']:,}",
        f"{ep['model_states_bytes'] / GIB:.2f} GiB", f"{total * 16 / GIB:.2f} GiB")


def test_gradient_compression_bytes(text):
    psi = planner.num_params(MODELS["llama-2-7b"])
    gb = {f: planner.grad_reduce_bytes(psi, f) / 1e9 for f in ("bf16", "fp32")}
    has(text["gc-01"], f"{psi:,}", f"{gb['bf16']:.2f} GB", f"{gb['fp32']:.2f} GB", f"{2 * gb['fp32']:.2f} GB",
        f"{planner.bus_bytes(planner.grad_reduce_bytes(psi, 'bf16'), 8) / 1e9:.2f} GB")
    assert planner.int8_levels(2) == 127 // 2
    r4, r1 = (planner.powersgd_bytes([(4096, 4096)], r) for r in (4, 1))
    whole = planner.grad_reduce_bytes(4096 * 4096, "fp32")
    has(text["gc-03"], f"{r4:,} bytes", f"{r1:,} bytes", f"{whole:,}",
        f"{planner.compression_ratio(whole, r4):.0f}x fewer")


def test_pipeline_schedule_figures(text):
    from labkit.planner.pipeline import handoffs_per_micro_batch

    interleaved = planner.interleaved_bubble_fraction(4, 8, 2)
    has(text["zb-01"], f"= {interleaved:.2f} of the step", f"= {interleaved / (1 - interleaved):.2f}",
        f"idles 3/11 = {planner.gpipe_bubble_fraction(4, 8):.2f}",
        f"{planner.gpipe_bubble_fraction(4, 8) / (1 - planner.gpipe_bubble_fraction(4, 8)):.3f}")
    assert (handoffs_per_micro_batch("interleaved_1f1b", 4, 1, 2), handoffs_per_micro_batch("1f1b", 4, 1)) == (4, 2)
    has(text["zb-02"], "rank 1 sends 4 tensors per micro-batch against 2")
    held = planner.in_flight_micro_batches
    has(text["zb-05"], f"p = {held('zero_bubble', 4, 16, 0)} micro-batches", f"= {planner.zb_h2_in_flight(4)}",
        f"{held('zero_bubble', 4, 16, 3)} on stage 3, where 1F1B holds {held('1f1b', 4, 16, 3)}")
    has(text["zb-06"], f"holds p = {held('zero_bubble', 4, 8, 0)} on every rank",
        f"holds 2p half-stage modules, {held('zbv', 4, 8, 0) // 2} whole stages",
        f"1F1B {planner.gpipe_bubble_fraction(4, 8):.2f}, ZB1P {planner.zero_bubble_fraction(4, 8):.2f}, "
        f"ZBV {planner.zbv_bubble_fraction(4, 8):.2f}",
        f"holds {held('interleaved_1f1b', 4, 8, 0, 2) / 2} stages' worth", f"2p - 1 = {planner.zb_h2_in_flight(4)}")
