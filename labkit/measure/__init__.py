"""Measurement: timing, memory, FLOPs and roofline units. Techniques never import this package."""
