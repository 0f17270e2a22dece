"""What TorchDynamo did since the last `reset`: the graphs it made, the graph breaks, and the
recompiles (each a guard that failed). Dynamo keeps these counts in `torch._dynamo.utils`, which
has no public name; labkit reads them here only."""
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
