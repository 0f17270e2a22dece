"""The harness: runs an experiment's sweep (reference first, each variant checked, then measured), launches multi-process runs, and the GPU self-check."""
