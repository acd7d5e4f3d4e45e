"""Benchmarks users run, `python -m eagle3.bench NAME`: `step` (the training step, the default),
`attention` and `loss` (the TTT kernels against their alternatives). Current figures: benchmarks/RESULTS.md."""
