"""kernels.tiles: the autotune candidates of each Triton kernel by GPU family, and the pruning that
gives the running GPU its family's list."""
import importlib

import pytest
import torch

from eagle3.models import quant
from kernels import tiles

ttt_attention = importlib.import_module("kernels.ttt_attention")   # the module (the package exports the function)

LIMIT_KB = {"large": 227, "a100": 163, "small": 99}   # shared memory a block may use, per family
D = 128   # the attention's head dim at which the lists were counted (the larger one supported)


def _attention_kb(kernel, config):
    """The attention's pipelined tiles (stages x k, v; q, dO in dK/dV) plus its resident ones, bf16."""
    m, n, _, stages = config
    rows = {"fwd": m + 2 * stages * n, "dkdv": 2 * n + 2 * stages * m, "dq": 2 * m + 2 * stages * n}[kernel]
    return rows * D * 2 / 1024


def _w4a16_kb(config):
    """Per stage an x tile and the packed int4 tile, plus the dequantised tile the dot reads, bf16."""
    n, k, _, stages = config
    m = quant.W4A16_BLOCK_M["gpu"]
    return (stages * (m * k * 2 + n * k // 8 * 4) + n * k * 2) / 1024


@pytest.mark.parametrize("capability, name", [((9, 0), "large"), ((10, 0), "large"), ((10, 3), "large"),
                                              ((8, 0), "a100"), ((8, 6), "small"), ((8, 9), "small"),
                                              ((12, 0), "small"), ((7, 5), "small")])
def test_family_by_compute_capability(capability, name):
    assert tiles.family(capability) == name


def test_every_list_fits_its_family_by_count_and_ends_with_the_fallback():
    for family, lists in ttt_attention.CONFIGS.items():
        for kernel, configs in lists.items():
            assert configs[-1] == ttt_attention.FALLBACK, (family, kernel)
            for c in configs:
                assert _attention_kb(kernel, c) <= LIMIT_KB[family], (family, kernel, c, _attention_kb(kernel, c))
    for family, configs in quant.W4A16_CONFIGS.items():
        assert configs[-1] == quant.W4A16_FALLBACK, family
        assert all(_w4a16_kb(c) <= LIMIT_KB[family] for c in configs), family
    # the fallbacks fit any GPU Triton supports (48 KB of static shared memory)
    assert max(_attention_kb(k, ttt_attention.FALLBACK) for k in ("fwd", "dkdv", "dq")) <= 48
    assert _w4a16_kb(quant.W4A16_FALLBACK) <= 48


@pytest.mark.parametrize("capability", [(9, 0), (8, 0), (8, 9), (12, 0)])
def test_the_autotuners_keep_the_running_gpus_family(monkeypatch, capability):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    family = tiles.family(capability)
    args = {"Q": torch.zeros(1), "T": 4}
    for kernel, tuned in ttt_attention._TUNED.items():
        kept = tuned.early_config_prune(tuned.configs, args)
        assert [ttt_attention._as_tuple(c) for c in kept] == [
            c for c in tiles.union({f: ttt_attention.CONFIGS[f][kernel] for f in tiles.FAMILIES})
            if c in ttt_attention.CONFIGS[family][kernel]]
        assert sorted(map(ttt_attention._as_tuple, kept)) == sorted(ttt_attention.CONFIGS[family][kernel])
    tuned = quant._w4a16_tuned(128)
    kept = tuned.early_config_prune(tuned.configs, {"x": torch.zeros(1)})
    assert sorted(map(quant._as_tuple, kept)) == sorted(quant.W4A16_CONFIGS[family])


def test_union_needs_a_list_per_family():
    with pytest.raises(ValueError, match="one per family"):
        tiles.union({"large": [(1, 2, 3, 4)]})
