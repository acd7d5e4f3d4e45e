"""kernels.tiles: the autotune candidates of each Triton kernel by GPU family, and the pruning that
gives the running GPU its family's list."""
import importlib

import pytest
import torch

from eagle3.kernels import tiles

ttt_attention = importlib.import_module("eagle3.kernels.ttt_attention")   # the module (the package exports the function)

LIMIT_KB = {"large": 227, "a100": 163, "small": 99}   # shared memory a block may use, per family
D = 128   # the attention's head dim at which the lists were counted (the larger one supported)


def _attention_kb(kernel, config):
    """The attention's pipelined tiles (stages x k, v; q, dO in dK/dV) plus its resident ones, bf16."""
    m, n, _, stages = config
    rows = {"fwd": m + 2 * stages * n, "dkdv": 2 * n + 2 * stages * m, "dq": 2 * m + 2 * stages * n}[kernel]
    return rows * D * 2 / 1024


@pytest.mark.parametrize("capability, name", [((9, 0), "large"), ((10, 0), "large"), ((10, 3), "large"),
                                              ((8, 0), "a100"), ((8, 7), "a100"), ((8, 6), "small"),
                                              ((8, 9), "small"), ((12, 0), "small"), ((7, 5), "small")])
def test_family_by_compute_capability(capability, name):
    assert tiles.family(capability) == name
    assert tiles.family(capability, hip=True) == "small"   # AMD: 64 KB of LDS whatever it reports


def test_every_list_fits_its_family_by_count_and_ends_with_the_fallback():
    for family, lists in ttt_attention.CONFIGS.items():
        for kernel, configs in lists.items():
            assert configs[-1] == ttt_attention.FALLBACK, (family, kernel)
            for c in configs:
                assert _attention_kb(kernel, c) <= LIMIT_KB[family], (family, kernel, c, _attention_kb(kernel, c))
    # the fallbacks fit any GPU Triton supports (48 KB of static shared memory)
    assert max(_attention_kb(k, ttt_attention.FALLBACK) for k in ("fwd", "dkdv", "dq")) <= 48


@pytest.mark.parametrize("capability, hip", [((9, 0), False), ((8, 0), False), ((8, 9), False), ((12, 0), False),
                                             ((9, 4), True)])
def test_the_autotuners_keep_the_running_gpus_family_in_its_order(monkeypatch, capability, hip):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.version, "hip", "6.2" if hip else None)
    family = tiles.family(capability, hip)
    assert ttt_attention.TUNED, "run without TRITON_INTERPRET: the interpreter builds no autotuners"
    for kernel, tuned in ttt_attention.TUNED.items():
        kept = tuned.early_config_prune(tuned.configs, {"Q": torch.zeros(1), "T": 4})
        assert [tiles.as_tuple(c, ("BLOCK_M", "BLOCK_N")) for c in kept] == ttt_attention.CONFIGS[family][kernel]


def test_on_an_h200_the_tuner_tries_the_tuned_lists_unchanged():
    """The "large" lists are the ones measured; the union the autotuners hold starts with them."""
    for kernel, tuned in ttt_attention.TUNED.items():
        tuned_there = ttt_attention.CONFIGS["large"][kernel]
        first = [tiles.as_tuple(c, ("BLOCK_M", "BLOCK_N")) for c in tuned.configs][:len(tuned_there)]
        assert first == tuned_there
    from benchmarks.attention_sweep import SWEEP
    assert ttt_attention.FALLBACK not in SWEEP["fwd"]
    assert all(c in SWEEP[k] for f in tiles.FAMILIES for k in ("fwd", "dkdv", "dq")
               for c in ttt_attention.CONFIGS[f][k] if c != ttt_attention.FALLBACK)


def test_every_tuned_attention_config_sets_its_tma_tiles():
    """The autotuned launch (never run on the CPU) gets the descriptors' tiles from each config's
    pre-hook, for the tiling that config launches."""
    from types import SimpleNamespace
    for tuned in ttt_attention.TUNED.values():
        assert all(c.pre_hook is ttt_attention.block_rows for c in tuned.configs)
    descs = {n: SimpleNamespace(block_shape=[16, 128]) for n in ("Qd", "DOd", "Kd", "Vd")}
    ttt_attention.block_rows({**descs, "BLOCK_M": 64, "BLOCK_N": 32})
    assert [descs[n].block_shape for n in ("Qd", "DOd", "Kd", "Vd")] == [[64, 128], [64, 128], [32, 128], [32, 128]]
    ttt_attention.block_rows({"Qd": None, "Kd": None, "Vd": None, "BLOCK_M": 64, "BLOCK_N": 32})   # no TMA
