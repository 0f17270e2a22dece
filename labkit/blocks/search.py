"""The largest size that fits: `find_largest` grows from a start by doubling steps while a probe
says it fits, then bisects between the last fit and the first miss, recording every probe
(`Search`). The batch finder searches batch sizes with it, the finetune experiment sequence
lengths."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable


@dataclass
class Search:
    """The largest size that fit (0: none did), every probe in order as (size, fitted), the cap."""

    found: int
    probes: list[tuple[int, bool]] = field(default_factory=list)
    cap: int = 0

    @property
    def capped(self) -> bool:
        return self.found == self.cap


def find_largest(fits: Callable[[int], bool], *, start: int, cap: int, step: int) -> Search:
    """Largest n in [1, cap] with fits(n). From `start`, while it fits, go up by `step`, doubling
    the step each time (start=1, step=1: 1, 2, 4, 8, ...); at the first miss, bisect between the
    last fit and it. At the end fits(found) and not fits(found + 1) have both been probed (unless
    found == cap), which holds even where fitting is not monotone in n."""
    search = Search(0, cap=cap)

    def tried(n: int) -> bool:
        ok = fits(n)
        search.probes.append((n, ok))
        return ok

    lo, hi = 0, cap + 1  # invariant: lo fits (0 trivially), hi does not (cap + 1: out of range)
    n = min(max(start, 1), cap)
    while tried(n):
        lo = n
        if n == cap:
            break
        n, step = min(n + step, cap), step * 2
    else:  # a miss (not the break at the cap)
        hi = n
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if tried(mid) else (lo, mid)
    search.found = lo
    return search
