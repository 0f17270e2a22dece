"""Imported last by the server the ranks are forked from (`ranks.RANK_PRELOAD`): everything the
server imported is frozen out of the garbage collector's walks (`gc.freeze`) there, once, so that
no rank forked from it walks those objects again at its first variant (a warm 2-rank launch of
tiny data_parallel: 3.15 CPU-s without it, 2.86 with it, on the reference CPU)."""
from labkit.measure.memory import freeze_survivors

freeze_survivors()
