"""The one clock (labkit.measure.clock) and the meters' blind spots (labkit.measure.modes): what each
primitive calls and synchronises, that `unmetered()` hides a block from every dispatch-mode meter,
that no module outside labkit/measure/ touches torch's private dispatch-mode stack, and that
torch's private names are used in labkit/measure/ and labkit/hardware.py alone."""
from __future__ import annotations

import ast
import re
import time
from pathlib import Path

import pytest
import torch

from labkit.measure import clock as clk
from labkit.measure.flops import make_flop_counter
from labkit.measure.memory import MemoryMeter
from labkit.measure.modes import is_metered, unmetered

LABKIT = Path(__file__).resolve().parents[1] / "labkit"
PRIVATE_MODE_API = re.compile(r"_get_current_dispatch_mode|_disable_current_modes|_push_mode|_pop_mode")
MIB = 2**20


# --- the boundary: private dispatch-mode functions live in labkit/measure/ alone -----------------

def private_mode_users(root: Path) -> dict[str, list[str]]:
    """Module path -> the private dispatch-mode names it mentions."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        names = sorted(set(PRIVATE_MODE_API.findall(path.read_text(encoding="utf-8"))))
        if names:
            found[path.relative_to(root).as_posix()] = names
    return found


def test_no_module_outside_measure_touches_the_private_dispatch_mode_stack():
    users = private_mode_users(LABKIT)
    outside = {path: names for path, names in users.items() if not path.startswith("measure/")}
    assert outside == {}, f"use labkit.measure.modes (unmetered, is_metered) instead: {outside}"
    # the scan sees what it looks for: modes.py, the one owner, is found by it
    assert "measure/modes.py" in users


def test_the_scan_flags_a_technique_that_reaches_for_the_private_stack(tmp_path):
    (tmp_path / "techniques").mkdir()
    (tmp_path / "techniques" / "sneaky.py").write_text(
        "from torch.utils._python_dispatch import _disable_current_modes\n")
    assert private_mode_users(tmp_path) == {"techniques/sneaky.py": ["_disable_current_modes"]}


# --- the boundary: torch's private names (torch._x, torch.utils._x, ._cdata) in measure/ and
# hardware.py alone, but for two that torch offers under no other name

PRIVATE_TORCH_ALLOWED = {
    # torch's only fp8 GEMM in core (torchao's float8 wraps it); the matmul experiment's fp8 variant
    ("techniques/matmul.py", "torch._scaled_mm"),
    # CUDA graphs replay at fixed addresses: the decode cache must be marked so (reduce-overhead)
    ("techniques/compiling.py", "torch._dynamo.mark_static_address"),
    # the inverse of the public context_parallel's sharding (its load-balanced order) lives only
    # in its private module in torch 2.13; the GPU-only torch_cp variant reads its results whole
    ("techniques/context_parallel.py", "torch.distributed.tensor.experimental._attention.context_parallel_unshard"),
}


def _private(name: str) -> bool:
    return any(part.startswith("_") and not part.startswith("__") for part in name.split(".")[1:])


def private_torch_users(root: Path) -> dict[str, list[str]]:
    """Module path -> the private torch names its code uses: imports of torch modules or names
    whose path has a `_part`, `torch._x` attribute chains, and a storage's `._cdata`. Names in
    strings and comments are not code, and are not counted."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        names = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names |= {a.name for a in node.names if a.name.startswith("torch") and _private(a.name)}
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch"):
                names |= {f"{node.module}.{a.name}" for a in node.names
                          if _private(f"{node.module}.{a.name}")}
            elif isinstance(node, ast.Attribute):
                parts, base = [node.attr], node.value
                while isinstance(base, ast.Attribute):
                    parts.append(base.attr)
                    base = base.value
                name = ".".join(["torch", *reversed(parts)])
                if isinstance(base, ast.Name) and base.id == "torch" and _private(name):
                    names.add(name)
                if node.attr == "_cdata":
                    names.add("._cdata")
        if names:  # a chain is also seen as each of its prefixes: keep the longest
            found[path.relative_to(root).as_posix()] = sorted(
                n for n in names if not any(m != n and m.startswith(n + ".") for m in names))
    return found


@pytest.mark.slow
def test_no_module_outside_measure_and_hardware_uses_a_private_torch_name():
    users = private_torch_users(LABKIT)
    outside = {path: [n for n in names if (path, n) not in PRIVATE_TORCH_ALLOWED]
               for path, names in users.items()
               if not path.startswith("measure/") and path != "hardware.py"}
    assert {p: n for p, n in outside.items() if n} == {}, \
        "reach torch's private names through labkit.measure or labkit.hardware"
    # the scan sees what it looks for: the owners, and each allowed use, are found by it
    assert "torch._dynamo.utils.counters" in users["measure/compiler.py"]
    assert "._cdata" in users["measure/memory.py"]
    assert all(name in users.get(path, []) for path, name in PRIVATE_TORCH_ALLOWED)


def test_the_torch_scan_flags_private_names_and_not_strings(tmp_path):
    (tmp_path / "techniques").mkdir()
    (tmp_path / "techniques" / "sneaky.py").write_text(
        "import torch\nfrom torch.utils._pytree import tree_leaves\n"
        "torch._dynamo.reset()\nkey = t.untyped_storage()._cdata\n"
        "note = 'torch._scaled_mm'  # torch._C in a comment\ntorch.compiler.reset()\n")
    assert private_torch_users(tmp_path) == {"techniques/sneaky.py": [
        "._cdata", "torch._dynamo.reset", "torch.utils._pytree.tree_leaves"]}


# --- unmetered / is_metered ----------------------------------------------------------------------

def test_unmetered_allocations_are_invisible_to_the_memory_meter():
    with MemoryMeter("cpu") as meter:
        with unmetered():
            hidden = torch.empty(MIB // 4)  # 1 MiB fp32, not seen
        assert meter.current_bytes == 0 and meter.peak_bytes == 0
        seen = torch.empty(2 * MIB, dtype=torch.uint8)  # the meter is back on the stack
        assert meter.current_bytes == 2 * MIB
        del hidden, seen


def test_unmetered_flops_are_invisible_to_the_flop_counter():
    a, b = torch.randn(8, 16), torch.randn(16, 4)
    with make_flop_counter() as counter:
        with unmetered():
            a @ b
        assert counter.get_total_flops() == 0
        a @ b
    assert counter.get_total_flops() == 2 * 8 * 16 * 4  # multiply-add = 2


def test_is_metered_sees_the_meters_and_not_inside_unmetered():
    assert not is_metered()
    with MemoryMeter("cpu"):
        assert is_metered()
        with unmetered():
            assert not is_metered()
        assert is_metered()
    with make_flop_counter():
        assert is_metered()
    assert not is_metered()


# --- the clock -----------------------------------------------------------------------------------

@pytest.fixture
def syncs(monkeypatch) -> list:
    """The devices torch.cuda.synchronize was called with (none is really called)."""
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(device))
    return calls


def test_clock_drains_a_cuda_device_first_and_never_the_cpu(syncs):
    assert clk.clock("cpu") <= clk.clock("cpu")  # perf_counter: monotonic
    assert syncs == []
    clk.clock("cuda:1")
    clk.clock(torch.device("cuda", 0))
    assert syncs == ["cuda:1", torch.device("cuda", 0)]


def test_seconds_drains_the_device_before_and_after_the_call(syncs):
    order = []
    clk.seconds(lambda: order.append(len(syncs)), "cuda:0")
    assert order == [1] and syncs == ["cuda:0", "cuda:0"]  # one sync before the call, one after


def test_seconds_measures_the_call():
    assert clk.seconds(lambda: time.sleep(0.02), "cpu") >= 0.02  # sleep can only overshoot


def test_repeat_seconds_runs_the_warmup_untimed_then_each_repeat():
    calls = []
    times = clk.repeat_seconds(lambda: calls.append(1), device="cpu", repeats=4, warmup=2)
    assert len(times) == 4 and len(calls) == 6 and all(t >= 0 for t in times)


def test_timed_calls_keeps_calling_until_the_minimum_time_and_stops_at_max_calls():
    times = clk.timed_calls(lambda: time.sleep(0.01), device="cpu", warmup=1, min_run_time_s=0.05,
                            min_repeats=1, max_calls=1000)
    # it stops at the first call that fills the minimum time (not a count of 10 ms calls: under a
    # 0.4-core quota one such call took 70 ms)
    assert sum(times) >= 0.05 * 0.9 and sum(times[:-1]) < 0.05
    calls = []
    capped = clk.timed_calls(lambda: calls.append(1), device="cpu", warmup=0, min_run_time_s=60.0,
                             min_repeats=1, max_calls=7)
    assert len(capped) == 7 == len(calls)
    assert len(clk.timed_calls(lambda: None, device="cpu", warmup=0, min_run_time_s=0.0,
                               min_repeats=5, max_calls=100)) == 5


class FakeEvent:
    """torch.cuda.Event on a CPU build: records when it was recorded and waited for."""

    log: list = []

    def __init__(self, enable_timing: bool = False):
        assert enable_timing

    def record(self):
        self.log.append(("record", self))

    def synchronize(self):
        self.log.append(("synchronize", self))

    def elapsed_time(self, end) -> float:
        return 250.0  # ms


def test_cuda_span_records_around_the_block_and_reports_seconds(monkeypatch):
    FakeEvent.log = []
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    with clk.CudaSpan() as span:
        FakeEvent.log.append(("block", None))
    assert [kind for kind, _ in FakeEvent.log] == ["record", "block", "record"]
    assert span.seconds == 0.25  # elapsed_time's ms -> s, after waiting for the end event
    assert FakeEvent.log[-1] == ("synchronize", span.end)


def test_fixed_repeats_timer_runs_the_same_count_after_a_barrier(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=(tmp_path / "store").as_uri(), rank=0, world_size=1)
    try:
        calls = []
        times = clk.fixed_repeats_timer(lambda: calls.append(1), warmup=2, repeats=3, device="cpu")
    finally:
        dist.destroy_process_group()
    assert len(times) == 3 and len(calls) == 5
