"""What TorchDynamo did since the last `reset`: the graphs it made, the graph breaks, and the
recompiles (each a guard that failed). Dynamo keeps these counts in `torch._dynamo.utils`, which
has no public name; labkit reads them here only, as it asks Inductor's CPU backend here only which
vector instructions its kernels use."""
from __future__ import annotations

import json
import os
import tempfile

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
    lists, into its on-disk cache, and loads each in a child process (about 2 s on the reference
    CPU; inside a compile under `force_disable_caches` it builds them all again, about 9 s of a
    15 s cold compile). Where every ISA the CPU lists passed, labkit stores that verdict beside
    those builds, keyed by torch's version, the C++ compiler and the ISAs (`_isa_key`); a later
    process with the same key tells Inductor so (`cpp.vec_isa_ok`) and neither builds nor loads.
    A key that differs, or an ISA that failed, and Inductor checks as it would without labkit."""
    from torch._inductor import config, cpu_vec_isa

    key, path = _isa_key(), _isa_verdict_path()
    if key is not None and config.cpp.vec_isa_ok is None and _read_verdict(path) == key:
        config.cpp.vec_isa_ok = True
    isa = cpu_vec_isa.pick_vec_isa()
    if key is not None and config.cpp.vec_isa_ok is None and \
            [str(i) for i in cpu_vec_isa.valid_vec_isa_list()] == key["isas"]:
        _write_verdict(path, key)
    return str(isa)


def _isa_key() -> dict | None:
    """What the ISA checks' verdict depends on: torch's version, the compiler (its path, size and
    time) and the ISAs that this CPU's flags list, best first. None off x86, where Inductor's
    list is not made by those checks."""
    import platform
    import shutil

    from torch._inductor import cpp_builder, cpu_vec_isa

    if platform.machine() not in ("x86_64", "AMD64"):
        return None
    compiler = shutil.which(cpp_builder.get_cpp_compiler())
    if compiler is None:
        return None
    stat = os.stat(compiler)
    flags = cpu_vec_isa.x86_isa_checker()
    isas = [str(i) for i in cpu_vec_isa.supported_vec_isa_list if all(f in flags for f in str(i).split())]
    return {"torch": torch.__version__, "compiler": [compiler, stat.st_size, stat.st_mtime_ns], "isas": isas}


def _isa_verdict_path() -> str:
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return os.path.join(cache_dir(), "labkit-isa-verdict.json")


def _read_verdict(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _write_verdict(path: str, key: dict) -> None:
    """Written whole or not at all (a temporary file renamed); a folder that cannot be written
    leaves the next process to check again."""
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=os.path.dirname(path), delete=False) as f:
            json.dump(key, f)
        os.replace(f.name, path)
    except OSError:
        pass
