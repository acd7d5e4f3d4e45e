"""Benchmarks users run, `python -m eagle3.bench NAME`: `step` (the training step, the default),
`attention` and `loss` (the TTT kernels against their alternatives), `float8` (the casts and GEMMs of
`train.float8`), `rows` (the row spread and RMSNorm kernels against torch's). Current figures:
benchmarks/RESULTS.md."""
