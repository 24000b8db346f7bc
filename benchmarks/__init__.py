"""Benchmarks: the SD 1.5 kernel/memory/time report against XLA (`python -m benchmarks.sd15_plan`)."""
