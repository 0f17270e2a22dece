"""torch.compile: what a compiler buys, what it costs up front, and when it pays for itself
(how Dynamo, AOTAutograd and Inductor get there: notebooks/text/18_compile.md).

- `eager` (the reference): plain PyTorch, one kernel per op.
- `default`: `torch.compile` with Inductor's default mode: fusion, no autotuning. On a CPU each
  generated kernel is a C++ file built by its own compiler run, about a second each on the
  reference CPU and most of a cold compile; `cpp_wrapper` puts a graph's kernels and the code
  that calls them (Python otherwise) in one file: one compiler run a graph.
- `max-autotune-no-cudagraphs` (GPU): also benchmarks Triton GEMM and conv templates against the
  vendor libraries and keeps the fastest: a longer compile for (sometimes) faster matmuls.
- `reduce-overhead` (GPU): replays the whole step as a CUDA graph, one launch instead of one per
  kernel: what a launch-bound step (small batch decode) needs.

`target` picks what is compiled: `block` (one transformer block, forward + backward, training)
or `decode` (one decode step of the whole model with a static KV cache, inference). The decode
step keeps its shapes fixed, as gpt-fast does: the cache is written at a position *tensor* and
attention reads the whole buffer under a mask, so each new token changes data, not shapes, and
nothing recompiles. (A cache read up to a Python-int length, `StaticCache`, changes a shape every
token: Dynamo recompiles, then marks the length dynamic.)

Every compiled variant starts cold (`torch.compiler.reset()`, Inductor's on-disk caches off
unless `inductor_cache`): its first call is timed in `check()` (`first_call_ms`, `compile_s` =
first call minus the second). On a CPU, Inductor's once-a-process choice of vector instructions
comes first, outside that time and with its cache (`isa_check_s`: test programs built and
loaded once a machine, `labkit.measure.compiler`), so that `compile_s` is the model's compile. Then
`decode_steps` more positions (decode) count recompiles; after the harness's timing, eager and compiled calls timed in turns give the break-even:
compile_s / (eager - compiled) steps, or never when compiled is not faster. The outputs (and
for `block` the gradients) must equal eager's within the dtype's tolerance before anything is
timed.
"""
from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass
from typing import Callable

import torch

from labkit import hardware, planner
from labkit.config import ConfigError, RunConfig, knob, torch_dtype
from labkit.measure import compiler
from labkit.measure.clock import clock, seconds
from labkit.measure.modes import unmetered
from labkit.blocks.model import Block, build_model, rope_tables
from labkit.blocks.kv_caches import StaticCache
from labkit.workload import Comparison, Workload

VARIANTS = ("eager", "default", "max-autotune-no-cudagraphs", "reduce-overhead")
REFERENCE = "eager"
# smaller sizes of the default CPU run, cheapest last (labkit.harness.budget). The last compiles
# the smallest graph there is, one 1-layer decode step, with one g++ run: on a CPU five times
# slower than the reference one, a block's cold compile alone takes over a minute
CPU_RUNGS = ({"probe_calls": 10}, {"probe_calls": 5, "num_layers": 1},
             {"probe_calls": 5, "num_layers": 1, "target": "decode", "cpp_wrapper": True})

GPU_ONLY = ("max-autotune-no-cudagraphs", "reduce-overhead")
# Largest |compiled - eager| / max|eager| over outputs (and gradients) that still counts as equal:
# fusion reorders floating-point sums, so bits differ, never more than rounding.
TOLERANCE = {"float32": 1e-4, "bfloat16": 3e-2, "float16": 1e-2}


@dataclass(kw_only=True)
class Config(RunConfig):
    variant: str = knob(REFERENCE, choices=VARIANTS, help="eager or a torch.compile mode")
    target: str = knob("block", choices=("block", "decode"),
                       help="block: one block, forward + backward; decode: one decode step")
    prompt_len: int = knob(16, min=1, help="decode: tokens in the cache before the timed step")
    decode_steps: int = knob(8, min=1, help="decode: positions decoded in check (recompiles counted)")
    max_cache_len: int = knob(0, min=0, help="decode: cache length (0: prompt_len + decode_steps)")
    probe_calls: int = knob(20, min=1, help="steady calls of eager and compiled for the break-even")
    inductor_cache: bool = knob(False, help="keep Inductor's on-disk caches (off: every compile cold)")
    cpp_wrapper: bool = knob(False, help="mode default: Inductor's C++ wrapper, one C++ file (one "
                                         "compiler run) a graph, not one a kernel")


def validate(cfg: Config) -> None:
    if cfg.target == "decode" and cache_len(cfg) > cfg.model.max_seq_len:
        raise ConfigError(f"cache length {cache_len(cfg)} is longer than the model's context "
                          f"({cfg.model.max_seq_len}); valid: max_cache_len <= {cfg.model.max_seq_len}")
    if cfg.target == "decode" and cache_len(cfg) < cfg.prompt_len + cfg.decode_steps:
        raise ConfigError(f"max_cache_len={cfg.max_cache_len} cannot hold prompt_len + decode_steps "
                          f"= {cfg.prompt_len + cfg.decode_steps}; valid: 0 or at least that")


def skip_reason(cfg: Config) -> str | None:
    if cfg.variant == REFERENCE:
        return None
    on_cpu = not cfg.device.startswith("cuda")
    if on_cpu and cfg.variant in GPU_ONLY:
        return (f"mode {cfg.variant} is GPU-only here: it tunes Triton kernels or captures "
                "CUDA graphs; this is a CPU (mode default runs)")
    if cfg.cpp_wrapper and cfg.variant != "default":
        return "cpp_wrapper is set, an option of mode default here (eager and default run)"
    if on_cpu:
        return hardware.inductor_cpu_problem()
    missing = "Inductor's GPU backend needs triton, which is not installed"
    return None if hardware.has_triton() else missing


def cache_len(cfg: Config) -> int:
    return cfg.max_cache_len or cfg.prompt_len + cfg.decode_steps


# --- the two targets: a zero-argument step, and what check() compares ------------------------------

class PositionalCache(StaticCache):
    """StaticCache's buffers, written at the positions in `self.pos` (a tensor) and read whole:
    every decode step has the same shapes, so a compiled step never recompiles. The keys past a
    row's position are hidden by the model's per-row causal mask."""

    def __init__(self, **shape):
        super().__init__(**shape)
        self.pos = torch.zeros(1, dtype=torch.long, device=self.keys[0].device)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.keys[layer].index_copy_(2, self.pos, k.to(self.keys[layer].dtype))  # (B, KV, L, hd)
        self.values[layer].index_copy_(2, self.pos, v.to(self.values[layer].dtype))
        return self.keys[layer].to(k.dtype), self.values[layer].to(v.dtype)


@dataclass
class Target:
    """`fn`: the function compiled; `run(fn)`: the timed step through `fn` (eager or compiled);
    `check(fn, i)`: copies of the outputs of check's call i (a decode position), of `num_checks`."""

    fn: Callable
    run: Callable[[Callable], dict[str, torch.Tensor]]
    check: Callable[[Callable, int], dict[str, torch.Tensor]]
    num_checks: int = 1


def make_block(cfg: Config) -> Target:
    m = dataclasses.replace(cfg.model, num_layers=1)
    block: Block = build_model(m, device=cfg.device, dtype=torch_dtype(cfg.dtype), seed=cfg.seed,
                               attention=cfg.attention).layers[0]
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    x = torch.randn(cfg.batch_size, cfg.seq_len, m.hidden_size, generator=gen)
    x = x.to(cfg.device, torch_dtype(cfg.dtype)).requires_grad_()
    rope = rope_tables(torch.arange(cfg.seq_len, device=cfg.device), m.head_dim, m.rope_theta, m.rope_llama3)

    def loss_fn(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = block(x, 0, None, cfg.attention, rope)  # (B, T, d)
        return y, y.float().square().mean()

    def run(fn: Callable) -> dict[str, torch.Tensor]:
        block.zero_grad(set_to_none=True)
        x.grad = None
        y, loss = fn(x)
        loss.backward()
        grads = {f"grad.{n}": p.grad for n, p in block.named_parameters()}
        return {"output": y, "grad.input": x.grad, **grads}

    return Target(loss_fn, run, lambda fn, i: clone(run(fn)))


def make_decode(cfg: Config) -> Target:
    m = cfg.model
    model = build_model(m, device=cfg.device, dtype=torch_dtype(cfg.dtype), seed=cfg.seed,
                        attention=cfg.attention).eval()
    cache = PositionalCache(num_layers=m.num_layers, batch=cfg.batch_size, kv_heads=m.num_kv_heads,
                            head_dim=m.head_dim, max_len=cache_len(cfg), dtype=torch_dtype(cfg.dtype),
                            device=cfg.device)
    if cfg.variant == "reduce-overhead":  # CUDA graphs may mutate only inputs at fixed addresses
        for t in cache.tensors() + [cache.pos]:
            torch._dynamo.mark_static_address(t)
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    text = torch.randint(0, m.vocab_size, (cfg.batch_size, cache_len(cfg)), generator=gen).to(cfg.device)
    P = cfg.prompt_len
    with torch.inference_mode():  # prefill, eager: positions 0 .. P-1 (tokens are teacher-forced)
        decode_pos, cache.pos = cache.pos, torch.arange(P, device=cfg.device)
        model(text[:, :P], cache=cache, last_only=True)
        cache.pos = decode_pos

    def decode(token: torch.Tensor) -> torch.Tensor:  # (B, 1) -> logits (B, 1, vocab)
        return model(token, start_pos=cache.pos.expand(token.shape[0]), cache=cache, last_only=True)

    @torch.inference_mode()
    def at(fn: Callable, i: int) -> dict[str, torch.Tensor]:
        cache.pos.fill_(P + i)
        return {"logits": fn(text[:, P + i:P + i + 1])}

    return Target(decode, lambda fn: at(fn, 0), lambda fn, i: clone(at(fn, i)), cfg.decode_steps)


def clone(outputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Detached copies (a CUDA-graph replay overwrites its outputs)."""
    return {k: v.detach().clone() for k, v in outputs.items() if v is not None}


# --- the experiment --------------------------------------------------------------------------------

def compile_fn(fn: Callable, cfg: Config) -> Callable:
    if cfg.variant == "default":
        compiled = torch.compile(fn, options={"cpp_wrapper": True} if cfg.cpp_wrapper else None)
    else:
        compiled = torch.compile(fn, mode=cfg.variant)
    if cfg.variant != "reduce-overhead":
        return compiled

    def step(*args):  # tells the CUDA-graph trees that the previous step's outputs are done
        torch.compiler.cudagraph_mark_step_begin()
        return compiled(*args)

    return step


def build(cfg: Config) -> Workload:
    target = make_block(cfg) if cfg.target == "block" else make_decode(cfg)
    if cfg.variant == REFERENCE:
        return Workload(step=lambda: target.run(target.fn),
                        check=lambda: {"runs": check_runs(target, target.fn)},
                        tokens_per_step=tokens_per_step(cfg), notes=notes(cfg), compute_dtype=cfg.dtype)
    compiler.reset()  # a fresh compile: no graph, guard or counter left from another variant
    fn = compile_fn(target.fn, cfg)
    found: dict[str, float] = {}
    messages = {**notes(cfg), **recompile_notes()}

    def check() -> dict:
        # The harness's memory tracker is a TorchDispatchMode, under which Dynamo will not compile
        # (it runs eager); step outside it so the cold call really compiles, and is timed here.
        with unmetered():
            if not cfg.device.startswith("cuda"):
                start = clock("cpu")
                isa = compiler.inductor_cpu_isa()
                found["isa_check_s"] = clock("cpu") - start
                messages["isa_check_s"] = (
                    f"Inductor's choice of vector instructions for its C++ kernels ({isa} here), "
                    "made once a process, before the timed first call and with Inductor's on-disk "
                    "cache: the first process on a machine builds a test program per ISA and loads "
                    "each; a later one reads that all passed (labkit.measure.compiler). Not part "
                    "of compile_s.")
            with torch.compiler.config.patch(force_disable_caches=not cfg.inductor_cache):
                runs = []
                found["first_call_s"] = seconds(lambda: runs.append(target.check(fn, 0)), cfg.device)
                runs += check_runs(target, fn, start=1)  # the next positions: do they recompile?
                found["second_call_s"] = seconds(lambda: target.run(fn), cfg.device)
        return {"runs": runs}

    def report() -> dict[str, float]:  # after the harness's timing: both paths are warm by now
        found.update(probe(target, fn, cfg))
        return {**compile_rows(found), **compiler.compile_counts()}

    return Workload(step=lambda: target.run(fn), check=check, tokens_per_step=tokens_per_step(cfg),
                    report=report, notes=messages, compute_dtype=cfg.dtype)


def check_runs(target: Target, fn: Callable, start: int = 0) -> list[dict[str, torch.Tensor]]:
    return [target.check(fn, i) for i in range(start, target.num_checks)]


def probe(target: Target, fn: Callable, cfg: Config) -> dict[str, float]:
    """Median steady seconds of eager and compiled, timed in turns on the same inputs (after a
    warm-up call each), so a slow stretch of a shared machine hits both alike."""
    eager, compiled = [], []
    target.run(target.fn), target.run(fn)
    for _ in range(cfg.probe_calls):
        eager.append(seconds(lambda: target.run(target.fn), cfg.device))
        compiled.append(seconds(lambda: target.run(fn), cfg.device))
    return {"probe_eager_s": statistics.median(eager), "probe_compiled_s": statistics.median(compiled)}


def compile_rows(found: dict[str, float]) -> dict[str, float | None]:
    compile_s = max(found["first_call_s"] - found["second_call_s"], 0.0)
    saved_s = found["probe_eager_s"] - found["probe_compiled_s"]
    isa = {"isa_check_s": found["isa_check_s"]} if "isa_check_s" in found else {}
    return {**isa, "first_call_ms": 1e3 * found["first_call_s"], "compile_s": compile_s,
            "probe_eager_ms": 1e3 * found["probe_eager_s"],
            "probe_compiled_ms": 1e3 * found["probe_compiled_s"],
            # never: infinite, which the harness stores as no value with "measured inf" in its note
            "break_even_steps": compile_s / saved_s if saved_s > 0 else float("inf")}


def recompile_notes() -> dict[str, str]:
    """Messages read when report() runs: why Dynamo recompiled, if it did."""
    return {"num_recompiles": "guard failures (each one a recompile) seen by Dynamo since this "
                              "variant's reset; TORCH_LOGS=recompiles prints the reasons.",
            "break_even_steps": "compile_s / (probe_eager_ms - probe_compiled_ms): steps before "
                                "the compile has paid for itself; no value (never) when compiled "
                                "is not faster.",
            "peak_mem_bytes": "on the CPU, measured under a dispatch-mode tracker, under which "
                              "Dynamo runs eager: the eager step's peak."}


def tokens_per_step(cfg: Config) -> int:
    return cfg.batch_size * (cfg.seq_len if cfg.target == "block" else 1)


def compare(reference: dict, outputs: dict, cfg: Config) -> Comparison:
    """Every output (and gradient) within TOLERANCE of eager's, relative to eager's largest value."""
    worst, where = 0.0, ""
    for ref_run, run in zip(reference["runs"], outputs["runs"], strict=True):
        for name, ref in ref_run.items():
            diff = (run[name].float() - ref.float()).abs().max().item()
            rel = diff / max(ref.float().abs().max().item(), 1e-30)
            if rel > worst:
                worst, where = rel, name
    ok = worst <= TOLERANCE[cfg.dtype]
    message = "" if ok else f"{where} differs from eager by {worst:.2e} (relative; tolerance " \
                            f"{TOLERANCE[cfg.dtype]:.0e})"
    return Comparison({"max_rel_diff": worst}, ok, message)


def expected(cfg: Config) -> dict[str, float]:
    """FLOPs are eager's (compiling fuses memory traffic, not arithmetic); the model traces whole
    (no graph breaks) and the decode step's shapes are fixed (no recompiles)."""
    m = cfg.model
    if cfg.target == "block":
        m1 = dataclasses.replace(m, num_layers=1)
        attn = planner.attention_flops(m1, batch=cfg.batch_size, new=cfg.seq_len, keys=cfg.seq_len)
        linear = 2 * cfg.batch_size * cfg.seq_len * planner.block_linear_params(m1, biases=False)
        flops = 3 * linear + attn * (7 if cfg.attention == "sdpa" else 6) // 2
    else:
        flops = planner.forward_flops(m, batch=cfg.batch_size, new=1, keys=cache_len(cfg), logits=1)
    out = {"flops": flops, "max_rel_diff": 0.0}
    if cfg.variant != REFERENCE:
        out.update(num_graph_breaks=0, num_recompiles=0)
    return out


def notes(cfg: Config) -> dict[str, str]:
    what = ("one block forward + backward (training)" if cfg.target == "block" else
            f"one decode step of the whole model against a {cache_len(cfg)}-position cache")
    return {"flops": f"{what}; counted in eager (FlopCounterMode is a dispatch mode, under which "
                     "Dynamo does not run compiled code)."}

