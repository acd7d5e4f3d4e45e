"""DeepSeek-V3 / Kimi-K2.5 target: int4 unpacking, routing, YaRN, the forward against an independent
dense reference, streaming, and inspect on the tiny Kimi-K2.5-layout checkpoint."""
from __future__ import annotations

import itertools
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import KIMI_FIXTURE, ROOT
from eagle3.models.inspect import inspect
from eagle3.models import attention, deepseek, moe, quant, tiny
from eagle3.models.incremental import KVPool, LayerPass, PassLayout, SequenceCache
from eagle3.models.weights import Checkpoint, TargetError, read_config
from eagle3.models.streaming import TargetRunner


@pytest.fixture(scope="module")
def kimi(tmp_path_factory) -> Path:
    return tiny.make_kimi(tmp_path_factory.mktemp("kimi"))


# ---------------------------------------------------------------------------------------------
# int4

def _pack(values: np.ndarray) -> torch.Tensor:
    """Independent packer: ints -8..7 [out, in] -> int32 [out, in/8], bit by bit in uint32."""
    out, inp = values.shape
    words = np.zeros((out, inp // 8), dtype=np.uint32)
    for i in range(inp):
        words[:, i // 8] |= (values[:, i] + 8).astype(np.uint32) << np.uint32(4 * (i % 8))
    return torch.from_numpy(words.view(np.int32))


def test_int4_unpack_matches_independent_packer():
    assert _pack(np.arange(-8, 0)[None]).item() == 0x76543210
    rng = np.random.default_rng(0)
    values = rng.integers(-8, 8, size=(24, 96))
    packed = _pack(values)
    assert torch.equal(quant.unpack_int4(packed).long() - 8, torch.from_numpy(values))
    assert torch.equal(tiny.pack_int4(torch.from_numpy(values)), packed)
    scale = torch.rand(24, 3).to(torch.bfloat16)
    expect = torch.from_numpy(values).float() * scale.float().repeat_interleave(32, dim=1)
    assert torch.equal(quant.dequantize_int4(packed, scale, torch.float32), expect)
    assert torch.equal(quant.dequantize_int4(packed, scale, torch.bfloat16), expect.bfloat16())
    stacked = quant.dequantize_int4(torch.stack([packed, packed]), torch.stack([scale, scale]), torch.float32)
    assert stacked.shape == (2, 24, 96) and torch.equal(stacked[1], expect)


_TRITON_CHECK = """
import sys, numpy as np, torch
sys.path.insert(0, sys.argv[1])
from eagle3.models import quant
rng = np.random.default_rng(1)
for shape in [(3, 40, 64), (70, 96)]:
    packed = torch.from_numpy(rng.integers(-2**31, 2**31, size=(*shape[:-1], shape[-1] // 8)).astype(np.int32))
    scale = torch.randn(*shape[:-1], shape[-1] // 32).to(torch.bfloat16)
    assert torch.equal(quant._dequantize_triton(packed, scale, torch.float32),
                       quant.dequantize_int4_torch(packed, scale, torch.float32)), shape
print("ok")
"""


def interpreted(script: str) -> None:
    """Run `script` in a child with TRITON_INTERPRET=1 (it must be set before triton is imported);
    the script prints "ok" when its checks pass."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, "-c", script, str(ROOT)], env=env,
                         capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stdout + out.stderr[-2000:]


def test_triton_dequant_kernel_interpreted():
    interpreted(_TRITON_CHECK)   # fp32 output: the interpreter's bf16 rounding differs from the GPU's


# ---------------------------------------------------------------------------------------------
# routing and YaRN

def _spec(**kw) -> deepseek.DeepseekSpec:
    base = dict(q_lora_rank=None, kv_lora_rank=4, qk_nope_head_dim=4, qk_rope_head_dim=2, v_head_dim=4,
                first_k_dense_replace=0, moe_layer_freq=1, n_routed_experts=4, n_shared_experts=0,
                num_experts_per_tok=2, moe_intermediate_size=8, n_group=1, topk_group=1, norm_topk_prob=True,
                routed_scaling_factor=2.5, topk_method="noaux_tc")
    return deepseek.DeepseekSpec(**{**base, **kw})


def test_routing_chooses_by_biased_and_weights_by_unbiased_scores():
    s = torch.tensor([[0.9, 0.8, 0.7, 0.1]])
    logits = torch.log(s / (1 - s))
    idx, w = moe.route(logits, None, _spec().router)
    assert idx.tolist() == [[0, 1]]
    idx, w = moe.route(logits, torch.tensor([0.0, 0.0, 0.5, 0.0]), _spec().router)
    assert sorted(idx[0].tolist()) == [0, 2]
    expect = {0: 0.9 / 1.6 * 2.5, 2: 0.7 / 1.6 * 2.5}
    for e, weight in zip(idx[0].tolist(), w[0].tolist()):
        assert weight == pytest.approx(expect[e], rel=1e-6)
    # no normalization: the raw unbiased sigmoid times the scaling factor
    _, w = moe.route(logits, torch.tensor([0.0, 0.0, 0.5, 0.0]), _spec(norm_topk_prob=False).router)
    assert sorted(w[0].tolist()) == pytest.approx([0.7 * 2.5, 0.9 * 2.5])


def test_group_limited_routing():
    # 4 groups of 2; group scores (sum of both biased scores): g0 1.0, g1 1.3, g2 0.6, g3 1.2
    biased = torch.tensor([[0.95, 0.05, 0.65, 0.65, 0.3, 0.3, 0.6, 0.6]])
    logits = torch.log(biased / (1 - biased))
    spec = _spec(n_routed_experts=8, n_group=4, topk_group=2, num_experts_per_tok=3)
    idx, _ = moe.route(logits, None, spec.router)
    # expert 0 has the best single score but its group (0) is not among the two best (1 and 3)
    assert sorted(idx[0].tolist()) == [2, 3, 6]
    bias = torch.tensor([0.0, 0.5, 0, 0, 0, 0, 0, 0])  # lifts group 0 to 1.5: now groups 0 and 1
    idx, w = moe.route(logits, bias, spec.router)
    assert sorted(idx[0].tolist()) == [0, 2, 3]
    assert w.sum().item() == pytest.approx(2.5, rel=1e-6)


def test_yarn_tables_match_closed_form_for_kimi():
    cfg = read_config(KIMI_FIXTURE)
    spec = deepseek.DeepseekSpec.from_config(cfg)
    d, base, f, L0 = 64, 50000.0, 64.0, 4096

    def dim(r):
        return d * math.log(L0 / (2 * math.pi * r)) / (2 * math.log(base))

    low, high = max(math.floor(dim(32)), 0), min(math.ceil(dim(1)), d - 1)
    assert (low, high) == (8, 20) == deepseek.yarn_bounds(d, base, L0, 32.0, 1.0)
    expect = []
    for j in range(d // 2):
        ramp = min(max((j - low) / (high - low), 0.0), 1.0)
        expect.append(base ** (-2 * j / d) / f * ramp + base ** (-2 * j / d) * (1 - ramp))
    inv_freq, cos_scale, softmax_scale = deepseek.rope_tables(cfg, spec)
    torch.testing.assert_close(inv_freq, torch.tensor(expect, dtype=torch.float32))
    assert cos_scale == 1.0
    assert softmax_scale == pytest.approx(0.1446796, abs=5e-8)
    assert softmax_scale == pytest.approx(192 ** -0.5 * (0.1 * math.log(64) + 1) ** 2, rel=1e-12)


# ---------------------------------------------------------------------------------------------
# the forward against a dense reference

class DenseKimi:
    """Straightforward fp32 forward of one sequence: every expert dequantized up front (own
    unpacking), explicit softmax attention, complex-number RoPE, a per-token loop over experts."""

    def __init__(self, path: Path):
        self.ckpt = Checkpoint(path)
        self.c = json.loads((path / "config.json").read_text())["text_config"]

    def w(self, name: str) -> torch.Tensor:
        if self.ckpt.has(name + ".weight_packed"):
            words = self.ckpt.get(name + ".weight_packed").numpy().view(np.uint32)
            nibbles = np.stack([(words >> np.uint32(4 * j)) & np.uint32(15) for j in range(8)], -1)
            values = torch.from_numpy(nibbles.reshape(words.shape[0], -1).astype(np.int64) - 8).float()
            scale = self.ckpt.get(name + ".weight_scale").float()
            return values * scale.repeat_interleave(values.shape[1] // scale.shape[1], dim=1)
        return self.ckpt.get(name + ".weight").float()

    def norm(self, x, name):
        return self.w(name) * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.c["rms_norm_eps"])

    def rope(self, x):  # x [T, h, d]: adjacent pairs as complex numbers
        c, d = self.c, self.c["qk_rope_head_dim"]
        s = c["rope_scaling"]
        dim = lambda r: d * math.log(s["original_max_position_embeddings"] / (2 * math.pi * r)) / (  # noqa: E731
            2 * math.log(c["rope_theta"]))
        low, high = max(math.floor(dim(s["beta_fast"])), 0), min(math.ceil(dim(s["beta_slow"])), d - 1)
        inv = []
        for j in range(d // 2):
            ramp = min(max((j - low) / max(high - low, 1e-3), 0.0), 1.0)
            base = c["rope_theta"] ** (-2 * j / d)
            inv.append(base / s["factor"] * ramp + base * (1 - ramp))
        angle = torch.arange(x.shape[0], dtype=torch.float64)[:, None] * torch.tensor(inv, dtype=torch.float64)
        rot = torch.polar(torch.ones_like(angle), angle).to(torch.complex64)[:, None]
        return torch.view_as_real(torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2).contiguous()) * rot).flatten(-2)

    def attention(self, x, p):
        c, T = self.c, x.shape[0]
        nh, nope, rope, vd = c["num_attention_heads"], c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
        a = p + "self_attn."
        if c["q_lora_rank"] is None:
            q = x @ self.w(a + "q_proj").T
        else:
            q = self.norm(x @ self.w(a + "q_a_proj").T, a + "q_a_layernorm") @ self.w(a + "q_b_proj").T
        q = q.view(T, nh, nope + rope)
        kv_a = x @ self.w(a + "kv_a_proj_with_mqa").T
        kv = (self.norm(kv_a[:, :c["kv_lora_rank"]], a + "kv_a_layernorm") @ self.w(a + "kv_b_proj").T)
        kv = kv.view(T, nh, nope + vd)
        k_pe = self.rope(kv_a[:, None, c["kv_lora_rank"]:]).expand(T, nh, rope)
        q = torch.cat([q[..., :nope], self.rope(q[..., nope:])], -1)
        k = torch.cat([kv[..., :nope], k_pe], -1)
        mscale = 0.1 * c["rope_scaling"]["mscale_all_dim"] * math.log(c["rope_scaling"]["factor"]) + 1
        scores = torch.einsum("thd,shd->hts", q, k) * (nope + rope) ** -0.5 * mscale ** 2
        scores = scores.masked_fill(torch.ones(T, T).triu(1).bool(), float("-inf")).softmax(-1)
        out = torch.einsum("hts,shd->thd", scores, kv[..., nope:]).reshape(T, nh * vd)
        return out @ self.w(a + "o_proj").T

    def mlp(self, x, p):
        gate = torch.nn.functional.silu(x @ self.w(p + "gate_proj").T)
        return (gate * (x @ self.w(p + "up_proj").T)) @ self.w(p + "down_proj").T

    def moe(self, x, p):
        """MoE output [T, H] and each token's routing margin (k-th minus (k+1)-th allowed biased score)."""
        c = self.c
        scores = torch.sigmoid(x @ self.w(p + "mlp.gate").T)
        biased = scores + self.ckpt.get(p + "mlp.gate.e_score_correction_bias")
        E, G, k = c["n_routed_experts"], c["n_group"], c["num_experts_per_tok"]
        out, margins = torch.zeros_like(x), []
        for t in range(x.shape[0]):
            b = biased[t].tolist()
            group_score = [sum(sorted(b[g * E // G:(g + 1) * E // G])[-2:]) for g in range(G)]
            groups = sorted(range(G), key=lambda g: -group_score[g])[:c["topk_group"]]
            allowed = sorted((e for e in range(E) if e // (E // G) in groups), key=lambda e: -b[e])
            chosen = allowed[:k]
            margins.append(b[allowed[k - 1]] - b[allowed[k]])
            weights = scores[t, chosen] / (scores[t, chosen].sum() + 1e-20) * c["routed_scaling_factor"]
            for e, weight in zip(chosen, weights):
                out[t] += weight * self.mlp(x[t:t + 1], f"{p}mlp.experts.{e}.")[0]
        return out + self.mlp(x, p + "mlp.shared_experts."), torch.tensor(margins)

    def layer(self, h: torch.Tensor, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i on one sequence: output [T, H] and routing margins [T] (inf for a dense layer)."""
        p = f"layers.{i}."
        h = h + self.attention(self.norm(h, p + "input_layernorm"), p)
        x = self.norm(h, p + "post_attention_layernorm")
        if i < self.c["first_k_dense_replace"]:
            return h + self.mlp(x, p + "mlp."), torch.full((h.shape[0],), float("inf"))
        out, margins = self.moe(x, p)
        return h + out, margins

    def run(self, ids: torch.Tensor, cu: list[int]):
        """Packed sequences, each on its own: per layer its input, output and routing margins
        ([T, ...] each), and the post-norm final state."""
        ins, outs, margins = [], [], []
        h = self.w("embed_tokens")[ids]
        for i in range(self.c["num_hidden_layers"]):
            ins.append(h)
            per_seq = [self.layer(h[a:b], i) for a, b in zip(cu[:-1], cu[1:])]
            h = torch.cat([o for o, _ in per_seq])
            outs.append(h)
            margins.append(torch.cat([m for _, m in per_seq]))
        return ins, outs, margins, self.norm(h, "norm")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("variant", [{}, {"n_group": 4, "topk_group": 2, "q_lora_rank": None}])
def test_forward_matches_dense_reference(tmp_path, variant):
    path = tiny.make_kimi(tmp_path, layers=4, shards=2, seed=3, **variant)
    ref = DenseKimi(path)
    ids = torch.randint(0, 512, (45,), generator=torch.Generator().manual_seed(0))
    cu = [0, 17, 45]
    ins, outs, margins, final = ref.run(ids, cu)
    positions = torch.cat([torch.arange(b - a) for a, b in zip(cu[:-1], cu[1:])])
    # fp32: the whole chain agrees tightly, layer by layer
    model = deepseek.DeepseekTarget(Checkpoint(path), torch.device("cpu"), torch.float32)
    h = model.ckpt.get("embed_tokens.weight").float()[ids]
    for i in range(4):
        h = model.layer_forward(model.load_layer(i), h, positions, torch.tensor(cu))
        torch.testing.assert_close(h, outs[i], rtol=1e-4, atol=1e-4)
    # bf16: each layer from the reference's input, to bf16 tolerance; tokens whose routing is a
    # near-tie (margin < 0.005) may pick another expert after bf16 rounding and are left out
    model = deepseek.DeepseekTarget(Checkpoint(path), torch.device("cpu"), torch.bfloat16)
    for i in range(4):
        got = model.layer_forward(model.load_layer(i), ins[i].bfloat16(), positions, torch.tensor(cu))
        keep = margins[i] > 0.005
        assert keep.float().mean() > 0.85
        assert _rel(got[keep], outs[i][keep]) < 1e-2, (i, _rel(got[keep], outs[i][keep]))
    # the runner captures the right layers and the post-norm final state
    runner = TargetRunner(Checkpoint(path), [0, 1, 3], torch.device("cpu"), torch.float32, chunk_tokens=30)
    got = runner.run(ids, cu)
    torch.testing.assert_close(got["aux_hidden"], torch.cat([outs[0], outs[1], outs[3]], -1), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got["final_hidden"], final, rtol=1e-4, atol=1e-4)
    assert (got["target_argmax"].long() == (final @ ref.w("lm_head").T).argmax(-1)).float().mean() > 0.95


def test_streaming_chunks_give_the_same_output(kimi):
    ckpt = Checkpoint(kimi)
    ids = torch.randint(0, 512, (70,), generator=torch.Generator().manual_seed(1))
    cu = [0, 9, 20, 41, 70]
    small = TargetRunner(ckpt, [1, 2, 3], torch.device("cpu"), torch.float32, chunk_tokens=7).run(ids, cu)
    big = TargetRunner(ckpt, [1, 2, 3], torch.device("cpu"), torch.float32, chunk_tokens=1000).run(ids, cu)
    for key in small:
        torch.testing.assert_close(small[key], big[key], rtol=1e-5, atol=1e-5)


def test_a_moe_layer_takes_zero_tokens(kimi):
    model = deepseek.DeepseekTarget(Checkpoint(kimi), torch.device("cpu"), torch.float32)
    x = torch.zeros(0, model.cfg.hidden_size)
    out = model.layer_forward(model.load_layer(1), x, torch.zeros(0, dtype=torch.long), torch.tensor([0, 0]))
    assert out.shape == x.shape


def test_only_active_experts_are_dequantized(kimi, monkeypatch):
    model = deepseek.DeepseekTarget(Checkpoint(kimi), torch.device("cpu"), torch.float32)
    weights = model.load_layer(1)
    assert weights["experts.gate_up.weight_packed"].dtype == torch.int32  # kept packed after loading
    seen = []
    real = quant.dequantize_int4
    monkeypatch.setattr(quant, "dequantize_int4", lambda p, s, d: seen.append(p.shape[0]) or real(p, s, d))
    idx = torch.tensor([[5, 2], [2, 5], [5, 2]])
    moe.routed(weights, torch.randn(3, 64), idx, torch.ones(3, 2), 8, moe.weighted_swiglu, torch.float32)
    assert seen == [2, 2]  # gate_up and down of experts {2, 5} only


def test_experts_in_blocks_give_the_output_of_one_block(kimi, monkeypatch):
    model = deepseek.DeepseekTarget(Checkpoint(kimi), torch.device("cpu"), torch.float32)
    w = model.load_layer(1)   # a MoE layer with 8 int4 experts
    x = torch.randn(37, model.cfg.hidden_size, generator=torch.Generator().manual_seed(4))
    whole = model._moe(w, x)
    monkeypatch.setattr(moe, "EXPERT_BLOCK", 3)   # blocks of 3 experts, the last one short
    torch.testing.assert_close(model._moe(w, x), whole, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# the tiny checkpoint and inspect

def _key_types(obj):
    if isinstance(obj, dict):
        return {k: _key_types(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_key_types(v) for v in obj[:1]]
    return type(obj).__name__


def test_tiny_kimi_config_has_the_real_layout(kimi):
    real = json.loads(KIMI_FIXTURE.read_text())
    ours = json.loads((kimi / "config.json").read_text())
    assert _key_types(ours["text_config"]) == _key_types(real["text_config"])
    assert _key_types(ours["vision_config"]) == _key_types(real["vision_config"])
    assert set(ours) == set(real)
    ckpt = Checkpoint(kimi)
    assert ckpt.prefix == "language_model.model." and ckpt.head_name == "language_model.lm_head.weight"
    assert len(set(ckpt.weight_map.values())) == 3
    assert ckpt.info("layers.1.mlp.gate.e_score_correction_bias")["dtype"] == "F32"
    assert ckpt.info("layers.1.mlp.experts.0.up_proj.weight_packed") == {
        "name": "language_model.model.layers.1.mlp.experts.0.up_proj.weight_packed", "shape": [32, 8],
        "dtype": "I32"}
    assert ckpt.info("layers.1.mlp.experts.0.up_proj.weight_scale")["dtype"] == "BF16"
    assert not ckpt.has("layers.1.mlp.shared_experts.up_proj.weight_packed")


def test_inspect_counts_and_missing_expert(kimi, tmp_path):
    report = inspect(str(kimi))
    w = report["weights"]
    assert w["forward_tensors"] == w["tensors"] - 35 == 3 + 12 + 4 * (14 + 8 * 9)
    assert w["skipped"] == {"vision tower and projector: the text forward reads no image": 11 + 2 * 12}
    assert w["quantized_linears"] == {"int4": 4 * 8 * 3, "fp8": 0, "mxfp4": 0}
    assert report["moe"]["routed_experts"] == 8 and report["moe"]["shared_experts"] == 1
    assert report["quantization"]["format"] == "pack-quantized"

    broken = tmp_path / "broken"
    broken.mkdir()
    for f in kimi.iterdir():
        (broken / f.name).symlink_to(f)
    index = json.loads((kimi / "model.safetensors.index.json").read_text())
    gone = "language_model.model.layers.3.mlp.experts.5.down_proj.weight_scale"
    del index["weight_map"][gone]
    (broken / "model.safetensors.index.json").unlink()
    (broken / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(TargetError, match=r"model.safetensors.index.json: 1 of the 359 tensors .* first: "
                                          + gone.replace(".", r"\.")):
        inspect(str(broken))
    out = subprocess.run([sys.executable, "-m", "eagle3", "inspect", str(broken)], cwd=ROOT,
                         capture_output=True, text=True)
    assert out.returncode != 0 and gone in out.stderr and "model.safetensors.index.json" in out.stderr


def test_decoding_with_caches_matches_the_full_forward(kimi):
    model = deepseek.DeepseekTarget(Checkpoint(kimi), torch.device("cpu"), torch.float32)
    weights = model.load_layer(1)
    h = torch.randn(20, 64, generator=torch.Generator().manual_seed(4))
    cu = torch.tensor([0, 12, 20])
    full = model.layer_forward(weights, h, torch.cat([torch.arange(12), torch.arange(8)]), cu)
    pool, parts = KVPool(1), {0: [], 1: []}
    caches = [SequenceCache(pool), SequenceCache(pool)]
    for (a0, b0), (a1, b1) in (((0, 5), (0, 3)), ((5, 6), (3, 8)), ((6, 12), (8, 8))):
        x = torch.cat([h[a0:b0], h[12 + a1:12 + b1]])
        layout = PassLayout(pool, caches, [b0 - a0, b1 - a1], torch.device("cpu"))
        torch.testing.assert_close(layout.positions, torch.cat([torch.arange(a0, b0), torch.arange(a1, b1)]))
        out = model.layer_forward(weights, x, layout.positions, layout.cu, cache=LayerPass(pool, 0, layout))
        caches[0].length, caches[1].length = b0, b1
        parts[0].append(out[:b0 - a0])
        parts[1].append(out[b0 - a0:])
    torch.testing.assert_close(torch.cat(parts[0] + parts[1]), full, rtol=1e-5, atol=1e-5)


def test_expert_matmul_multiplies_each_group_by_its_expert():
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(11, 16, generator=g), torch.randn(3, 8, 16, generator=g)
    expect = torch.cat([x[:4] @ w[0].T, x[4:] @ w[2].T])
    torch.testing.assert_close(moe.expert_matmul(x, w, [4, 0, 7]), expect)


@pytest.mark.parametrize("dv", [8, 12, 16])
def test_packed_causal_attention_with_another_v_width(dv):
    """MLA's v (v_head_dim) is narrower than q/k (or as wide, or wider): each packed sequence attends
    causally on its own, the output has v's width, GQA heads share their group's k/v (explicit
    softmax as reference)."""
    g = torch.Generator().manual_seed(3)
    lengths, hq, hkv, d = [5, 1, 9], 4, 2, 12
    T = sum(lengths)
    q, k, v = torch.randn(T, hq, d, generator=g), torch.randn(T, hkv, d, generator=g), torch.randn(T, hkv, dv, generator=g)
    cu = torch.tensor([0, *itertools.accumulate(lengths)])
    out = attention.causal_attention_packed(q, k, v, cu, scale=0.3)
    assert out.shape == (T, hq, dv)
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        kk, vv = (x[a:b].repeat_interleave(hq // hkv, 1) for x in (k, v))        # [n, hq, *]
        scores = torch.einsum("qhd,khd->hqk", q[a:b], kk) * 0.3
        scores = scores.masked_fill(torch.ones(b - a, b - a).triu(1).bool(), float("-inf"))
        torch.testing.assert_close(out[a:b], torch.einsum("hqk,khd->qhd", scores.softmax(-1), vv))
