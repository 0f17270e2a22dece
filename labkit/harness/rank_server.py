"""Imported last by the server the ranks are forked from (`ranks.RANK_PRELOAD`): everything the
server imported is frozen out of the garbage collector's walks (`gc.freeze`) there, once, so that
no rank forked from it walks those objects again at its first variant (a quarter of a second of
each rank's CPU time at every launch on the reference CPU)."""
from labkit.measure.memory import freeze_survivors

freeze_survivors()
