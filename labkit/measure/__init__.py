"""Measurement: the one clock (`clock`), memory, FLOPs, roofline units, and the meters' blind
spots (`modes`). Techniques import its primitives (`clock`, `modes`, `memory.is_out_of_memory`);
the harness (`labkit.harness.experiment`) runs the meters around them."""
