"""Building blocks the techniques share: the decoder and the reference model, greedy decoding, the
training step and its transforms, the sharded (DTensor) step, the serving engine and a workload's
replay under a scheduler, KV caches, request workloads, the pipeline schedule, rank helpers, the
largest-size search and our kernels. Nothing here imports the harness or presentation, and what two
experiments share lives here, never in one of them."""
