"""Benchmarks, `python -m eagle3.bench NAME`: `step` (the training step, the default), `quality`
(real acceptance length of our draft against the peer's on a small real target), `attention` and
`loss` (the TTT kernels against their alternatives), `moe` (a Kimi-K2.5 MoE layer and a streamed
extraction), `fp8` (the casts and GEMMs of `train.float8`), `rows` (the row spread and RMSNorm
kernels against torch's), `online` (online training's target placements against offline extraction
+ training, issue 15), `node` (the 8-GPU node's scaling, extraction and kill/resume checks, issue
16), `tiles` (every autotune tiling built for each GPU of its family, on any machine: no timing).
The timed ones use `eagle3.bench.timing`; figures in bench/RESULTS.md."""
