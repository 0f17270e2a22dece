"""Claims of the parallelism questions of issue 29 (cp-, moe-, gc-, zb-): ring and Ulysses bytes,
causal work per rank, Mixtral's parameters, expert-parallel traffic and memory, compressed
gradients' bytes, and the pipeline schedules' bubbles and micro-batches in flight."""
from __future__ import annotations

import dataclasses

from labkit import planner
from labkit.blocks import ring as rings
from labkit.blocks.layout import Layout
from labkit.blocks.recipe import Recipe, planned_memory
from labkit.config import MODELS, RunConfig, resolve
from labkit.planner.pipeline import handoffs_per_micro_batch
from labkit.study.claims.base import GIB, MIB, Claim

M8 = planner.MIXTRAL_8X7B  # the published Mixtral-8x7B shape
PSI = planner.num_params(MODELS["llama-2-7b"])
RING = dict(batch=1, kv_heads=8, seq_len=32768, head_dim=128, n=4)  # cp-01's layer on 4 ranks
MATRIX = [(4096, 4096)]  # gc-03's gradient matrix
held = planner.in_flight_micro_batches


def ring_mib(n: int) -> int:
    """cp-02: the ring's bytes a rank sends, MiB, on n ranks at 16,384 tokens each, bf16."""
    return planner.ring_sent_bytes(**{**RING, "seq_len": 16384 * n, "n": n}, e=2) // MIB


def ratio(fraction: float) -> float:
    """A bubble as the ratio of idle to busy time, from its share of the step."""
    return fraction / (1 - fraction)


def ep_layer_bytes() -> float:
    """moe-04: one Mixtral layer's dispatch and combine of 4,096 tokens on 8 GPUs, bf16,
    forward and backward."""
    return planner.uniform_offrank_bytes(dataclasses.replace(M8, num_layers=1), 4096, 8, dtype_bytes=2)
handoffs = handoffs_per_micro_batch


CLAIMS = [
    Claim('cp-01', '= 32 MiB',
          lambda: f"= {planner.cp_block_bytes(1, 8, 32768, 128, 4) // MIB} MiB"),
    Claim('cp-01', '= 20 blocks',
          lambda: f"= {planner.ring_sends(4)} blocks"),
    Claim('cp-01', '640 MiB',
          lambda: f"{planner.ring_sent_bytes(**RING) // MIB} MiB"),
    Claim('cp-01', '192 MiB',
          lambda: f"{planner.ring_sent_bytes(**RING, backward=False) // MIB} MiB"),
    Claim('cp-02', '128 MiB',
          lambda: f"{planner.cp_block_bytes(1, 32, 16384 * 2, 128, 2, e=2) // MIB} MiB"),
    Claim('cp-02', '640 MiB',
          lambda: f"{planner.ulysses_all_to_all_bytes(1, 32, 8, 16384 * 2, 128, 2, e=2) // MIB} MiB"),
    Claim('cp-02', '1,408 MiB',
          lambda: f"{planner.ring_sent_bytes(**{**RING, 'seq_len': 16384 * 8, 'n': 8}, e=2) // MIB:,} MiB"),
    Claim('cp-03', '322 MiB',
          lambda: f"{planner.cp_activation_bytes(1, 32, 8, 131072, 128, 8, e=2) / MIB:.0f} MiB"),
    Claim('cp-03', '2.52 GiB',
          lambda: f"{planner.cp_activation_bytes(1, 32, 8, 131072, 128, 1, e=2) / GIB:.2f} GiB"),
    Claim('cp-04', '2,098,176 pairs on rank 0',
          lambda: f"{planner.causal_pairs(8192, 4)[0]:,} pairs on rank 0"),
    Claim('cp-04', '14,681,088 on rank 3',
          lambda: f"{planner.causal_pairs(8192, 4)[-1]:,} on rank 3"),
    Claim('cp-04', '8,389,632 pairs on every rank',
          lambda: f"{planner.causal_pairs(8192, 4, 'zigzag')[0]:,} pairs on every rank"),
    Claim('cp-04', '1.75 times',
          lambda: f"{planner.causal_imbalance(8192, 4):.2f} times"),
    Claim('moe-01', '46,702,792,704',
          lambda: f"{planner.num_params(M8):,}"),
    Claim('moe-01', '45,097,156,608',
          lambda: f"{planner.expert_params(M8):,}"),
    Claim('moe-01', '12,879,925,248',
          lambda: f"{planner.active_params(M8):,}"),
    Claim('moe-01', 'about 28%',
          lambda: f"about {planner.active_params(M8) / planner.num_params(M8):.0%}"),
    Claim('moe-02', '= 32 (labkit',
          lambda: f"= {planner.capacity(64, 2, 4, 1.0)} (labkit"),
    Claim('moe-02', '24 dropped',
          lambda: f"{planner.dropped_assignments([48, 40, 24, 16], 32)} dropped"),
    # uniform load and probabilities, top-2: the loss is k = 2 exactly
    Claim('moe-03', 'give exactly k',
          lambda: "give exactly k" if planner.load_balancing_loss([1, 1, 1, 1], [0.25] * 4, 2) == 2 else "?"),
    Claim('moe-04', '112 MiB in all',
          lambda: f"{ep_layer_bytes() / 2 / MIB:.0f} MiB in all"),
    Claim('moe-06', '5,637,144,576 expert parameters',
          lambda: f"{planner.ep_memory(M8, 8)['expert_params']:,} expert parameters"),
    Claim('moe-06', '1,605,636,096 replicated',
          lambda: f"{planner.ep_memory(M8, 8)['replicated_params']:,} replicated"),
    Claim('moe-06', '107.93 GiB',
          lambda: f"{planner.ep_memory(M8, 8, 'bf16_weights', 'adamw')['model_states_bytes'] / GIB:.2f} GiB"),
    Claim('moe-06', '695.93 GiB',
          lambda: f"{planner.num_params(M8) * 16 / GIB:.2f} GiB"),
    Claim('gc-01', '6,738,415,616',
          lambda: f"{PSI:,}"),
    Claim('gc-01', '13.48 GB per rank',
          lambda: f"{planner.grad_reduce_bytes(PSI, 'bf16') / 1e9:.2f} GB per rank"),
    Claim('gc-01', '26.95 GB',
          lambda: f"{planner.grad_reduce_bytes(PSI, 'fp32') / 1e9:.2f} GB"),
    Claim('gc-01', '23.58 GB at N = 8',
          lambda: f"{planner.bus_bytes(planner.grad_reduce_bytes(PSI, 'bf16'), 8) / 1e9:.2f} GB at N = 8"),
    Claim('gc-03', '131,072 bytes',
          lambda: f"{planner.powersgd_bytes(MATRIX, 4):,} bytes"),
    Claim('gc-03', '67,108,864 for the matrix',
          lambda: f"{planner.grad_reduce_bytes(4096 * 4096, 'fp32'):,} for the matrix"),
    Claim('gc-03', '512x fewer',
          lambda: f"{planner.compression_ratio(4 * 4096 * 4096, planner.powersgd_bytes(MATRIX, 4)):.0f}x fewer"),
    Claim('zb-01', '= 0.16 of the step',
          lambda: f"= {planner.interleaved_bubble_fraction(4, 8, 2):.2f} of the step"),
    Claim('zb-01', 'idles 3/11 = 0.27',
          lambda: f"idles 3/11 = {planner.gpipe_bubble_fraction(4, 8):.2f}"),
    Claim('zb-02', 'rank 1 sends 4 tensors per micro-batch against 2',
          lambda: (f"rank 1 sends {handoffs('interleaved_1f1b', 4, 1, 2)} tensors per micro-batch "
                  f"against {handoffs('1f1b', 4, 1)}")),
    Claim('zb-05', '(4 on stage 3, where 1F1B holds 1)',
          lambda: f"({held('zero_bubble', 4, 16, 3)} on stage 3, where 1F1B holds {held('1f1b', 4, 16, 3)})"),
    Claim('zb-05', '2p - 1 = 7',
          lambda: f"2p - 1 = {planner.zb_h2_in_flight(4)}"),
    Claim('zb-06', '1F1B 0.27, ZB1P 0.11, ZBV 0.06',
          lambda: (f"1F1B {planner.gpipe_bubble_fraction(4, 8):.2f}, ZB1P {planner.zero_bubble_fraction(4, 8):.2f}, "
                  f"ZBV {planner.zbv_bubble_fraction(4, 8):.2f}")),
    Claim('zb-06', "holds 5.5 stages' worth",
          lambda: f"holds {held('interleaved_1f1b', 4, 8, 0, 2) / 2} stages' worth"),
    Claim('cp-02', '256, 640',
          lambda: f"{ring_mib(2)}, {ring_mib(4)}"),
    Claim('moe-02', '19% of the assignments',
          lambda: f"{planner.dropped_assignments([48, 40, 24, 16], 32) / 128:.0%} of the assignments"),
    Claim('moe-04', '56 MiB for the dispatch',
          lambda: f"{ep_layer_bytes() / 4 / MIB:.0f} MiB for the dispatch"),
    Claim('moe-06', '7,242,780,672',
          lambda: f"{planner.ep_memory(M8, 8)['params']:,}"),
    Claim('gc-01', '53.91 GB',
          lambda: f"{2 * planner.grad_reduce_bytes(PSI, 'fp32') / 1e9:.2f} GB"),
    Claim('gc-03', '32,768 bytes',
          lambda: f"{planner.powersgd_bytes(MATRIX, 1):,} bytes"),
    Claim('zb-01', '= 0.19',
          lambda: f"= {ratio(planner.interleaved_bubble_fraction(4, 8, 2)):.2f}"),
    Claim('zb-01', '0.375',
          lambda: f"{ratio(planner.gpipe_bubble_fraction(4, 8)):.3f}"),
    Claim('zb-05', 'p = 4 micro-batches',
          lambda: f"p = {held('zero_bubble', 4, 16, 0)} micro-batches"),
    Claim('zb-06', 'holds p = 4 on every rank',
          lambda: f"holds p = {held('zero_bubble', 4, 8, 0)} on every rank"),
    Claim('zb-06', '4 whole stages',
          lambda: f"{held('zbv', 4, 8, 0) // 2} whole stages"),
    Claim('rcp-01', 'over dp_cp = 4 ranks',
          lambda: f"over dp_cp = {Layout.of(Recipe(tensor_parallel=2, context_parallel=2, zero_stage=2), 8).dp_cp} ranks"),
    Claim('rcp-02', 'positions 2, 3, 4, 5',
          lambda: "positions " + ", ".join(str(int(p)) for p in rings.positions(rings.pieces(8, 2, 1, "zigzag")))),
    Claim('rep-01', "dims {'dp_mod_ep': 2, 'ep': 2}",
          lambda: f"dims {Layout.of(Recipe(expert_parallel=2), 4).dims}"),
    Claim('rep-01', 'over dp_cp = 4 ranks',
          lambda: f"over dp_cp = {Layout.of(Recipe(expert_parallel=2), 4).dp_cp} ranks"),
    Claim('rep-02', '= 49,184',
          lambda: f"= {planner.all_to_all_bytes([[[5, 4], [7, 3]]], 0, hidden=256, num_experts=4):,}"),
    Claim('rpp-01', 'is 664,608 B', lambda: f"is {pp_activation('gpipe'):,} B"),
    Claim('rpp-01', '332,448 B: p - rank', lambda: f"{pp_activation('1f1b'):,} B: p - rank"),
    Claim('rpp-01', 'the batch\'s 288 B', lambda: f"the batch's {planner.pipeline.pipeline_token_bytes(4, 8)} B"),
]


def pp_activation(schedule: str) -> int:
    """rpp-01: rank 0's planned activation bytes of a 2-stage pipeline recipe (tiny, 2 blocks,
    4 rows of 8 tokens in 4 micro-batches)."""
    cfg = resolve(RunConfig, "tiny", {"device": "cpu", "num_layers": 2, "batch_size": 4, "seq_len": 8})
    plan = planned_memory(cfg, Recipe(pipeline_parallel=2, pp_schedule=schedule, micro_batches=4), 2, rank=0)
    return plan.activation_bytes
