"""What TorchDynamo did since the last `reset`: the graphs it made, the graph breaks, and the
recompiles (each a guard that failed). Dynamo keeps these counts in `torch._dynamo.utils`, which
has no public name; labkit reads them here only, as it asks Inductor's CPU backend here only which
vector instructions its kernels use."""
from __future__ import annotations

import torch
from torch._dynamo.utils import counters, guard_failures


def reset() -> None:
    """A fresh start: Dynamo's compiled graphs and guards dropped (`torch.compiler.reset`) and
    its counts zeroed."""
    torch.compiler.reset()
    counters.clear()
    guard_failures.clear()


def compile_counts() -> dict[str, int]:
    """num_graphs, num_graph_breaks and num_recompiles since the last `reset`."""
    return {"num_graphs": counters["stats"]["unique_graphs"],
            "num_graph_breaks": sum(counters["graph_break"].values()),
            "num_recompiles": sum(len(v) for v in guard_failures.values())}


def inductor_cpu_isa() -> str:
    """The vector instructions Inductor's C++ kernels use on this CPU (`pick_vec_isa`: avx512,
    avx2, ...). Inductor decides it once a process: it builds a test program with each ISA the CPU
    lists, into its on-disk cache, and loads each in a child process. A later process finds the
    builds and only loads them; inside a compile under `force_disable_caches` it builds them all
    again (on the reference CPU about 9 s of a 15 s cold compile)."""
    from torch._inductor import cpu_vec_isa

    return str(cpu_vec_isa.pick_vec_isa())
