"""Spark: MoE experts hot on the GPU and cold on the host (DESIGN §7): routing traces, placement under a byte
budget, and the GPU's expert slots with a cache of spare ones. Pure bookkeeping here; backends move bytes."""
