"""Benchmarks users run, `python -m eagle3.bench NAME`: `step` (the training step, the default),
`attention` and `loss` (the TTT kernels against their alternatives), `moe` (a Kimi-K2.5 MoE layer and
a streamed extraction), `float8` (the casts and GEMMs of `train.float8`), `rows` (the row spread and
RMSNorm kernels against torch's), `tiles` (every autotune tiling built for each GPU of its family, on
any machine: no timing). The current figures are in the repository's benchmarks/RESULTS.md."""
