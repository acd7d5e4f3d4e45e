"""Benchmarks: `python -m eagle3.bench` (the training step) and `python -m eagle3.bench quality`
(real acceptance length of our draft against the peer's on a small real target)."""
