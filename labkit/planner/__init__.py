"""The analytic model: the napkin math that experiments show beside their measurements.

It predicts, per GPU and from shapes alone (never fitted to a measurement): parameter counts and
the FLOPs of training and of generation, held to `labkit.blocks.model`'s own parameter count and
to FlopCounterMode in the tests; what one training step holds and its peak, under each precision,
ZeRO stage, tensor/pipeline degree and recomputation; the KV cache and serving; full, LoRA and
QLoRA fine-tuning; the cheapest plan that fits; with the papers' own formulas beside them
(`zero_model_state_bytes`, `korthikanti_activation_bytes`).

Where each part lives (each module imports only those above it in this list):
- `precision`: bytes per element for each precision recipe, K (`optimizer_bytes_per_param`),
  AdamW's 8- and 4-bit states (`low_bit_state_bytes`);
- `model`: parameter counts, FLOPs, the shapes one GPU holds under tp/pp (`stage_params`);
- `plan`: a plan's checked inputs (`_Run`, `_resolve`) and its result (`MemoryPlan`);
- `activations`: what the blocks keep for backward (`layer_activation_bytes`);
- `context`: context parallelism's bytes sent (ring, Ulysses), activations and causal work per rank;
- `sharding`: ZeRO's model states per stage, the ZeRO/FSDP2 working buffers and FSDP2's
  all-gathered bytes per step;
- `formulas`: each term of a training plan in words, for the table;
- `training`: `training_memory`, the step's timeline and its temporaries;
- `inference`: the KV cache, `inference_memory`;
- `search`: `recommend`, the cheapest plan that fits;
- `quantized`: a frozen base's bytes in NF4, int8 or int4, and one matmul's dequantization;
- `finetune`: full, LoRA, QLoRA and LoRA on int8/int4 bases, `finetune_memory`,
  `finetune_frontier`;
- `float8`: float8 training's converted linears, their copies' bytes and the Amdahl bound;
- `compression`: compressed gradients' bytes per rank and step (bf16, fp16, int8 with its
  scales, PowerSGD's P and Q), the ring's bus bytes, int8's headroom, 16-bit rounding bounds;
- `moe`: mixture of experts: total, active and per-expert-parallel-rank parameters, capacity and
  drops, uniform routing's load, the load-balancing loss, expert parallelism's all-to-all bytes;
- `pipeline`: each pipeline schedule's bubble (share of the step, ratio to the ideal) and
  micro-batches held per rank, a stage module's bytes saved for backward;
- `report`: `plan_report`, the answer of `labkit plan` and the notebook.

Every name is re-exported here: callers write `planner.training_memory`.
"""
from labkit.config import PRESETS, ConfigError
from labkit.planner.activations import korthikanti_activation_bytes, layer_activation_bytes
from labkit.planner.context import (SPLITS, causal_block_work, causal_idle_fraction, causal_imbalance,
                                     causal_pairs, check_split, cp_activation_bytes, cp_block_bytes,
                                     ring_sends, ring_sent_bytes, ulysses_all_to_all_bytes,
                                     ulysses_sent_bytes)
from labkit.planner.finetune import (BASE_FORMAT, FINETUNE_CHECKPOINTING, FINETUNE_METHODS,
                                     LORA_MODULES, LORA_TARGET_ALIASES, LORA_TARGET_NAMES,
                                     finetune_compute_dtype, finetune_frontier, finetune_memory,
                                     linear_shapes, linear_weight_bytes, lora_module_names,
                                     parse_lora_targets, trainable_params)
from labkit.planner.compression import (bus_bytes, compression_ratio, ddp_buckets, format_bytes,
                                        grad_reduce_bytes, int8_levels, int8_reduce_bytes,
                                        param_shapes, powersgd_bytes, powersgd_numel,
                                        rounding_tolerance)
from labkit.planner.float8 import (float8_cast_bytes, float8_flop_share, float8_shapes,
                                   float8_speedup_bound)
from labkit.planner.inference import inference_memory, kv_bytes_per_token, kv_cache_bytes
from labkit.planner.model import (LocalShape, StageParams, adamw_state_bytes, attention_flops,
                                  block_linear_params, block_tensors, check_tp, forward_flops,
                                  generate_flops, layer_params, local_shape, mlp_params, num_params,
                                  param_bytes, stage_params, stage_tensors, train_step_flops)
from labkit.planner.moe import (MIXTRAL_8X7B, active_params, all_to_all_bytes, capacity, check_ep,
                                dropped_assignments, ep_memory, ep_rank_params, expert_params,
                                load_balancing_loss, offrank_bytes, uniform_drop_fraction,
                                uniform_max_load_ratio, uniform_offrank_bytes)
from labkit.planner.plan import CHECKPOINTING, OPTIMIZER_IMPLS, ZERO_STAGES, MemoryPlan
from labkit.planner.pipeline import (gpipe_bubble_fraction, ideal_bubble_fraction,
                                     in_flight_micro_batches, interleaved_bubble_fraction,
                                     loss_activation_bytes, pipeline_token_bytes,
                                     stage_activation_bytes, zb_h2_in_flight, zbv_bubble_fraction,
                                     zero_bubble_fraction, zero_bubble_idle)
from labkit.planner.precision import (DTYPE_OF, FSDP2_BF16, LOW_BIT, OPTIMIZERS, PRECISION_BYTES,
                                      PRECISIONS, QUANTIZED_MIN, PrecisionBytes, low_bit_state_bytes,
                                      low_bit_update_bytes, optimizer_bytes_per_param,
                                      precision_bytes)
from labkit.planner.quantized import (INT4_GROUP_SIZE, NF4_BLOCK_SIZE, NF4_SCALER_BLOCKS, nf4_bytes,
                                      nf4_dequant_bytes, nf4_scaler_block, weight_only_bytes,
                                      weight_only_dequant_bytes)
from labkit.planner.report import GIB, plan_report
from labkit.planner.search import RECOMMENDED_PRECISIONS, SEARCH, Recommendation, recommend
from labkit.planner.sharding import fsdp2_all_gather_bytes, root_unit_params, zero_model_state_bytes
from labkit.planner.training import training_memory

# Private terms the tests reach as planner._NAME (held to saved-tensor hooks and measured buffers)
from labkit.planner.activations import _embedding_side_bytes  # noqa: F401
from labkit.planner.finetune import _kept_norm_bytes, _lora_layer_bytes  # noqa: F401
from labkit.planner.plan import _resolve  # noqa: F401
from labkit.planner.sharding import _zero_buffers  # noqa: F401

__all__ = ["MIXTRAL_8X7B", "active_params", "all_to_all_bytes", "capacity", "check_ep",
           "dropped_assignments", "ep_memory", "ep_rank_params", "expert_params", "load_balancing_loss", "mlp_params",
           "offrank_bytes", "uniform_drop_fraction", "uniform_max_load_ratio",
           "uniform_offrank_bytes",
           "BASE_FORMAT", "CHECKPOINTING", "ConfigError", "DTYPE_OF", "SPLITS", "FINETUNE_CHECKPOINTING",
           "FINETUNE_METHODS", "FSDP2_BF16", "GIB", "INT4_GROUP_SIZE", "LORA_MODULES",
           "LORA_TARGET_ALIASES", "LORA_TARGET_NAMES", "LOW_BIT", "LocalShape", "MemoryPlan", "NF4_BLOCK_SIZE", "NF4_SCALER_BLOCKS",
           "OPTIMIZERS", "OPTIMIZER_IMPLS", "PRECISIONS", "PRECISION_BYTES", "PRESETS",
           "PrecisionBytes", "QUANTIZED_MIN", "RECOMMENDED_PRECISIONS", "Recommendation", "SEARCH", "StageParams",
           "ZERO_STAGES", "adamw_state_bytes", "attention_flops", "block_linear_params",
           "block_tensors", "causal_block_work", "causal_idle_fraction", "causal_imbalance",
           "causal_pairs", "check_split", "check_tp", "cp_activation_bytes", "cp_block_bytes",
           "finetune_compute_dtype", "finetune_frontier",
           "finetune_memory", "float8_cast_bytes", "float8_flop_share", "float8_shapes",
           "float8_speedup_bound", "forward_flops", "fsdp2_all_gather_bytes", "generate_flops",
           "inference_memory", "korthikanti_activation_bytes", "kv_bytes_per_token",
           "kv_cache_bytes", "layer_activation_bytes", "layer_params", "linear_shapes",
           "linear_weight_bytes", "local_shape", "lora_module_names", "low_bit_state_bytes",
           "low_bit_update_bytes", "nf4_bytes",
           "nf4_dequant_bytes", "nf4_scaler_block", "num_params", "optimizer_bytes_per_param",
           "param_bytes", "parse_lora_targets", "plan_report", "precision_bytes", "recommend",
           "ring_sends", "ring_sent_bytes", "root_unit_params", "stage_params", "stage_tensors",
           "train_step_flops",
           "trainable_params", "training_memory", "ulysses_all_to_all_bytes", "ulysses_sent_bytes",
           "weight_only_bytes", "weight_only_dequant_bytes",
           "zero_model_state_bytes"]
__all__ += ["gpipe_bubble_fraction", "ideal_bubble_fraction", "in_flight_micro_batches",
            "interleaved_bubble_fraction", "loss_activation_bytes", "pipeline_token_bytes",
            "stage_activation_bytes", "zb_h2_in_flight", "zbv_bubble_fraction",
            "zero_bubble_fraction", "zero_bubble_idle"]
__all__ += ["bus_bytes", "compression_ratio", "ddp_buckets", "format_bytes", "grad_reduce_bytes",
            "int8_levels", "int8_reduce_bytes", "param_shapes", "powersgd_bytes", "powersgd_numel",
            "rounding_tolerance"]
