"""The measurements behind the exercises: each Run is measured once and shared by every exercise
that names it (a stored complete run of the same settings on the same machine is reused)."""
from __future__ import annotations

from labkit.study.exercises.core import Run

FAST = {"min_run_time_s": 0.0, "warmup": 0}
# The pipeline lab's per-layer cost: an injected sleep per block in every micro-batch forward, far
# above a tiny block's compute on a busy CPU, so that a stage's work follows the blocks it holds.
# The lab's splits of the 2 blocks over the 2 stages (blocks on stage 0, on stage 1), the broken
# one first; the two the lab reads are measured with the exercises' pipeline run.
BLOCK_COST_MS = 25.0
STAGE_LAYERS = ("2,0", "1,1", "0,2")
# Two CPU ranks (gloo) on any machine: the scenarios' per-rank bytes and bubble are the same on
# every device, and one GPU cannot hold two NCCL ranks. A run's own "device" wins over check()'s.
DIST = {**FAST, "timed_steps": 2, "seq_len": 16, "num_layers": 2, "timeout_s": 60, "device": "cpu",
        "nproc": 2}
# The recipe exercises' ladder, in the order its worked example climbs it: each rung adds one
# technique to the one before (the points of one Run, not a grid: nothing measured goes unread).
RECIPE_RUNGS = {"bf16 on DDP": {"checkpointing": "none", "micro_batches": 1, "zero_stage": 0},
                "+ full checkpointing": {"checkpointing": "full", "micro_batches": 1, "zero_stage": 0},
                "+ 2 micro-batches": {"checkpointing": "full", "micro_batches": 2, "zero_stage": 0},
                "+ ZeRO-2": {"checkpointing": "full", "micro_batches": 2, "zero_stage": 2}}
RUNS = {
    "mp": Run("mixed_precision", {**FAST, "batch_size": 1, "seq_len": 8, "steps": 1, "num_layers": 2},
              ("fp32", "fp16", "bf16_weights")),
    "ckpt": Run("checkpointing", {**FAST, "batch_size": 2, "seq_len": 32, "num_layers": 2},
                ("none", "full", "selective")),
    # 0.06 GiB: above the model states plus either device's AdamW temporaries (CPU 16Ψ + 8 MiB,
    # GPU 20Ψ), so the backward's activations set the micro-batch (8) on both; 36 = 4 x 8 + 4.
    "finder": Run("batch_finder", {**FAST, "num_layers": 1, "seq_len": 32, "memory_budget_gib": 0.06,
                                   "max_batch_size": 16, "mode": "grow", "effective_batch": 36}, ("fp32",)),
    "kv": Run("kv_cache", {**FAST, "prompt_len": 64, "new_tokens": 32, "num_layers": 1},
              ("none", "dynamic", "quantized")),
    "data": Run("dataloading", {**FAST, "batch_size": 2, "seq_len": 8, "steps": 2, "num_layers": 2,
                                "sample_cost_us": 50000.0}, ("baseline",)),
    # fp16 too (the dtype of the tensor-core scenarios); mult8 is 16-byte aligned, not 128-byte.
    "matmul": Run("matmul", {**FAST, "size": 256}, ("fp32", "fp16"),
                  {"alignment": ["aligned", "mult8", "off_by_one"]}),
    "access": Run("memory_access", {**FAST, "size_mib": 4.0, "stride": 4}, ("contiguous", "strided")),
    # 8 requests on 4 rows, outputs of 4 to 32 tokens: static runs two batches to their longest
    # output, continuous refills rows as requests finish (no preemption: the pool holds 4 rows)
    "serve": Run("batching", {"num_layers": 1, "num_requests": 8, "max_output_len": 32, "arrival": "closed",
                              "batch_size": 4}, ("sequential", "static", "continuous")),
    "zero": Run("zero", {**DIST, "batch_size": 2}, ("ddp", "zero1", "zero3")),
    # bf16 on the two gloo ranks at the ladder's four rungs (RECIPE_RUNGS: autocast on DDP,
    # FSDP2's policy under ZeRO-2); 65 MiB sits between the DDP rungs (70 MiB and more) and
    # ZeRO-2's (41 MiB).
    "recipe": Run("recipe", {**DIST, "batch_size": 8, "seq_len": 32, "precision": "bf16",
                             "budget_gib": 65 / 1024}, ("composed",), list(RECIPE_RUNGS.values())),
    # one process, 2 x 32 tokens of the tiny model's 4096-entry vocabulary, fp32: the plain loss,
    # the chunked one (16 tokens of logits at a time), 8-bit AdamW and packed rows, composed
    # against plain each
    "chunked": Run("recipe", {**FAST, "nproc": 1, "device": "cpu", "batch_size": 2, "seq_len": 32,
                              "num_layers": 1, "timed_steps": 2}, ("composed",),
                   [{"loss": "plain"}, {"loss": "chunked", "loss_chunk": 16}, {"optimizer": "adamw8bit"},
                    {"packing": True}]),
    # the GPipe drill's point (the split balanced by measured cost), then the pipeline lab's splits
    "pipe": Run("pipeline_parallel", {**DIST, "batch_size": 4, "micro_batches": 4, "delay_stage": 0},
                ("single", "gpipe"),
                [{"stage_delay_ms": 0.0},
                 *({"stage_layers": v, "block_cost_ms": BLOCK_COST_MS} for v in STAGE_LAYERS[:2])]),
    # the pipeline schedules the drills read, on the two gloo ranks: m = 4, v = 2 modules per rank
    "zb": Run("pipeline_parallel", {**DIST, "batch_size": 4, "micro_batches": 4, "virtual_stages": 2},
              ("single", "1f1b", "interleaved_1f1b", "zero_bubble")),
    "quant": Run("weight_quant", {**FAST, "prompt_len": 4, "new_tokens": 8, "num_layers": 1,
                                  "calib_sequences": 2, "calib_len": 64}, ("none", "int8", "int4", "gptq_int4")),
    # one layer, 16 tokens: the fp8 copies' bytes follow the shapes alone
    "fp8": Run("fp8", {**FAST, "num_layers": 1, "batch_size": 1, "seq_len": 16, "steps": 1}, ("fp8_rowwise",)),
    # the tiny preset: its random draft agrees by chance, its prompts' n-grams are what recur
    "spec": Run("speculative", {**FAST, "prompt_len": 8, "new_tokens": 16, "num_layers": 2},
                ("none", "draft", "prompt_lookup")),
    # the first 8 requests of shared_prefix (3 system prompts of 64 tokens), queued at t = 0, in a
    # pool that never runs out: no preemption or eviction, so the rows equal the tokens' counts
    "serve_prefix": Run("batching", {"num_layers": 1, "workload": "shared_prefix", "num_requests": 8,
                                     "max_output_len": 8, "arrival": "closed", "batch_size": 4,
                                     "kv_budget_tokens": 2048, "block_size": 16,
                                     "prefix_cache": True}, ("continuous",)),
    # LoRA r=8 on q,v (the defaults), 2 tiny layers; compute pinned to fp32 so CPU and GPU give
    # the same answers (AdamW's 8 bytes per trainable parameter, fp32 NF4 factors)
    "finetune": Run("finetune", {**FAST, "batch_size": 1, "seq_len": 32, "num_layers": 2,
                                 "compute": "fp32"}, ("lora", "qlora", "lora_int8")),
    # 6 seeded documents packed into rows of 64 tokens, 2 tiny layers: seconds on any CPU
    "packing": Run("packing", {**FAST, "num_layers": 2, "batch_size": 6, "seq_len": 64},
                   ("padded", "packed_naive", "packed")),
    # one attention layer of 64 tokens (4 q heads reading 2 kv heads) on the two gloo ranks
    "context": Run("context_parallel", {**DIST, "batch_size": 1, "seq_len": 64, "num_kv_heads": 2},
                   ("ring", "ring_zigzag")),
    # the tiny MoE (4 experts, top-2, capacity factor 1.25) on the two gloo ranks, 64 tokens each
    "moe": Run("moe", {**DIST, "batch_size": 2, "seq_len": 32, "timed_steps": 1}, ("single", "ep")),
    # DDP with the int8 and PowerSGD (rank 2) hooks on the two gloo ranks, 2 tiny layers
    "compression": Run("grad_compression", {**DIST, "batch_size": 2, "timed_steps": 1, "steps": 2,
                                            "powersgd_rank": 2}, ("int8", "powersgd")),
    # 8 requests of at most 16 tokens on 4 rows, two bisection steps: seconds on any CPU
    "sla": Run("sla", {"num_layers": 2, "num_requests": 8, "max_output_len": 16,
                       "batch_size": 4, "search_steps": 2}, ("continuous",)),
}
