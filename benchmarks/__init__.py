"""The lab, outside the wheel: harnesses that judge the product against its alternatives on the GPU
machine (`quality`: acceptance against the peer on a small real target; `online`: online training's
placements; `node`: an 8-GPU node's scaling and kill/resume), the device scripts that drive them
(`device/`), the peer's scripts (`peer/`), and RESULTS.md with the raw runs (`results/`). Run from
the repository root: `python -m benchmarks.quality --help`."""
