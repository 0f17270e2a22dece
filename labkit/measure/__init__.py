"""Measurement: the one clock (`clock`) and the step timer (`timer`), memory, FLOPs, energy,
roofline units, the device monitor, a step's memory over time (`timeline`), torch.profiler's
tables (`profiler`), collectives and their bytes (`comm`), this CPU's pace (`pace`), and the
meters' blind spots (`modes`). Techniques import its primitives (`clock`, `modes`, `comm`,
`memory.is_out_of_memory`); the harness (`labkit.harness.experiment`) runs the meters around
them."""
