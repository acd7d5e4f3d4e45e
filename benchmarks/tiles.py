"""`python -m benchmarks.tiles`: every autotune candidate of the TTT attention kernels compiled for
the GPUs of its family, and each block's shared memory set against what that GPU gives a block.

No GPU needed: `triton.compile` builds for a named target (PTX and cubin, with the ptxas Triton
ships), so this checks on any machine what the tile lists (`kernels.tiles`) promise for GPUs no one
here has: that each tiling compiles for every GPU of its family and fits its shared memory. What it
cannot say is how fast a tiling runs there. The GQA attention kernels are built at head dim 128,
packed sequences, bf16, with TMA loads on the GPUs that use them (sm_90, sm_100); the MLA draft's
(`kernels/mla_attention.py`) at Kimi's widths (128 + 64 and 128), pointer loads.

    python -m benchmarks.tiles [--families large,a100,small] [--jobs N]
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys
from concurrent.futures import ProcessPoolExecutor

from eagle3.kernels import tiles

# compute capabilities built per family, and the shared memory one block may use on each (bytes)
TARGETS = {"large": (90, 100), "a100": (80, 87), "small": (86, 89, 120)}
BLOCK_SMEM = {80: 166_912, 87: 166_912, 86: 101_376, 89: 101_376, 90: 232_448, 100: 232_448, 120: 101_376}

_ATTENTION_TYPES = {**{n: "*bf16" for n in ("Q", "K", "V", "PE", "O", "DO", "DK", "DV", "DQ")},
                    "LSE": "*fp32", "DELTA": "*fp32", "DS": "*fp32", "DPE": "*fp32", "CU_SEQLENS": "*i32",
                    **{f"{n}_STEPS": "*i64" for n in ("K", "V", "PE", "DK", "DV")},
                    "qk_scale": "fp32", "sm_scale": "fp32"}
# the attention kernels checked: the GQA one (head dim 128, 8 query heads a KV head) and the MLA draft's (Kimi's
# widths, 8 heads a dK/dV program), each at the trainer's shapes
ATTENTION = {"eagle3.kernels.ttt_attention": {"GROUP": 8, "HEAD_DIM": 128},
             "eagle3.kernels.mla_attention": {"GROUP": 8, "NOPE": 128, "ROPE": 64, "VDIM": 128, "ALIGN": 8}}


def _kernel(name: str, config: tuple, capability: int, module: str = "eagle3.kernels.ttt_attention"):
    """(jit function, argument types, constexprs but the tiling's) of `module`'s kernel `name`; the GQA
    attention loads through TMA descriptors where a launch would (`uses_tma`: the "large" family)."""
    attention = importlib.import_module(module)
    fn = attention.KERNELS[name]
    if module != "eagle3.kernels.ttt_attention":   # pointer loads only
        constexprs = {**ATTENTION[module], "VARLEN": True, "UPCAST": False}
        return fn, _ATTENTION_TYPES, {k: v for k, v in constexprs.items() if k in fn.arg_names}
    tma = tiles.family(divmod(capability, 10)) == "large"
    descriptors = [a for a in attention.DESCRIPTOR_ROWS if a in fn.arg_names]
    constexprs = {**ATTENTION[module], "VARLEN": True, "TMA": tma, "UPCAST": False}
    if not tma:
        return fn, _ATTENTION_TYPES, {**constexprs, **dict.fromkeys(descriptors)}
    rows = _tiling(config)   # BLOCK_M, BLOCK_N, as the launch's pre-hook sets the tiles
    types = {a: f"tensordesc<bf16[{rows[attention.DESCRIPTOR_ROWS[a]]}, 128]>" for a in descriptors}
    return fn, {**_ATTENTION_TYPES, **types}, constexprs


def _attrs(fn, types: dict, constexprs: dict) -> dict:
    """What a launch at the trainer's shapes specializes: pointers and integer arguments (strides,
    lengths, widths) divisible by 16, but the step count S. Without it the build would not vectorise
    or pipeline its loads, and would show less shared memory than a launch needs."""
    return {(i,): [["tt.divisibility", 16]] for i, a in enumerate(fn.arg_names)
            if a not in constexprs and a not in ("S", "H") and (types.get(a, "i32") == "i32" or types[a].startswith("*"))}


def _tiling(config: tuple) -> dict:
    return {"BLOCK_M": config[0], "BLOCK_N": config[1]}


def compile_one(name: str, config: tuple, capability: int, module: str = "eagle3.kernels.ttt_attention") -> int:
    """Shared memory (bytes) of one block of `module`'s kernel `name` with `config` built for sm_`capability`."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    fn, types, constexprs = _kernel(name, config, capability, module)
    constexprs = {**constexprs, **_tiling(config)}
    signature = {a: "constexpr" if a in constexprs else types.get(a, "i32") for a in fn.arg_names}
    src = ASTSource(fn=fn, signature=signature, attrs=_attrs(fn, types, constexprs),
                    constexprs={(fn.arg_names.index(k),): v for k, v in constexprs.items()})
    built = triton.compile(src, target=GPUTarget("cuda", capability, 32),
                           options={"num_warps": config[2], "num_stages": config[3]})
    return built.metadata.shared


def candidates(families: list[str]) -> list[tuple[str, str, tuple, int, str]]:
    """(kernel, family, config, capability, module) for every list entry of `families` and their GPUs, of each
    attention module."""
    jobs = []
    for module in ATTENTION:
        attention = importlib.import_module(module)
        jobs += [(name, f, c, cc, module) for name in attention.KERNELS for f in families
                 for c in attention.CONFIGS[f][name] for cc in TARGETS[f]]
    return jobs


def _run(job):
    name, family, config, cc, module = job
    try:
        return job, compile_one(name, config, cc, module), None
    except Exception as e:  # noqa: BLE001 - a tiling that does not build is what this reports
        return job, None, f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.tiles", description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", default=",".join(tiles.FAMILIES), help="comma list of " + ", ".join(tiles.FAMILIES))
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="compiles side by side")
    args = parser.parse_args(argv)
    families = [f for f in args.families.split(",") if f]
    if unknown := set(families) - set(tiles.FAMILIES):
        parser.error(f"unknown families {sorted(unknown)}; expected {', '.join(tiles.FAMILIES)}")
    jobs = candidates(families)
    print(f"{len(jobs)} builds: kernels' tile lists x their family's GPUs ({', '.join(f'{f}: sm_' + '/'.join(map(str, TARGETS[f])) for f in families)})",
          flush=True)
    print("| kernel | family | GPU | BLOCK_M/N, warps, stages | shared KiB | block limit KiB | fits |")
    print("| --- | --- | --- | --- | ---: | ---: | --- |")
    bad = 0
    with ProcessPoolExecutor(max(1, args.jobs)) as pool:
        for (name, family, config, cc, module), shared, error in pool.map(_run, jobs):
            fits = error is None and shared <= BLOCK_SMEM[cc]
            bad += not fits
            shown = f"{shared / 1024:.1f}" if shared is not None else f"build failed: {error}"
            print(f"| {module.split('.')[-1]} {name} | {family} | sm_{cc} | {config} | {shown} | {BLOCK_SMEM[cc] / 1024:.0f} | "
                  f"{'yes' if fits else '**no**'} |", flush=True)
    print(f"{len(jobs) - bad} of {len(jobs)} build and fit" + ("" if not bad else f"; {bad} do not"))
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
