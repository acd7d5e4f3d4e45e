"""The GQA MoE families (Qwen3-MoE, MiniMax-M2, GLM-4.5, gpt-oss): tiny targets in their published layouts, our
forward against transformers' own classes (whole, chunked, decoding), gpt-oss's MXFP4 experts, the engines'
auxiliary layers, and a draft trained, exported and decoded losslessly on each."""
import json
import shutil

import numpy as np
import pytest
import torch

from conftest import make_config
from eagle3 import extraction, train_state, training
from eagle3.evaluate import real_decoding
from eagle3.models import quant, tiny
from eagle3.models.incremental import IncrementalTarget
from eagle3.models.inspect import inspect
from eagle3.models.streaming import TargetRunner
from eagle3.models.weights import Checkpoint

FAMILIES = ["qwen3_moe", "minimax_m2", "glm4_moe", "gpt_oss"]
NAMES = {"qwen3_moe": "Qwen3-MoE", "minimax_m2": "MiniMax-M2", "glm4_moe": "GLM-4.5", "gpt_oss": "gpt-oss"}
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    cache = {}

    def target(family: str, weights: str = "bf16"):
        if (family, weights) not in cache:
            cache[family, weights] = tiny.make_moe(tmp_path_factory.mktemp(family), family, weights=weights)
        return cache[family, weights]
    return target


def _reference(path, ids: torch.Tensor, layers: list[int], dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' class of the family (5.24) on one sequence: (outputs of `layers` side by side, final state)."""
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()   # GLM's next-token-prediction layer: unexpected by its class
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="eager")
    with torch.no_grad():
        states = model(ids[None], output_hidden_states=True).hidden_states
    return torch.cat([states[i + 1][0] for i in layers], -1), states[-1][0]


@pytest.mark.parametrize("family", FAMILIES)
def test_forward_equals_transformers_whole_and_chunked(made, family):
    """Two sequences past gpt-oss's 128-token window, packed whole and in 50-token chunks."""
    path, layers, cu = made(family), [0, 1, 2], [0, 150, 320]
    ids = torch.randint(0, 256, (cu[-1],), generator=torch.Generator().manual_seed(1))
    for chunk in (1000, 50):
        out = TargetRunner(Checkpoint(path), layers, CPU, torch.float32, chunk_tokens=chunk).run(ids, cu)
        for a, b in zip(cu[:-1], cu[1:]):
            aux, final = _reference(path, ids[a:b], layers)
            torch.testing.assert_close(out["aux_hidden"][a:b], aux, rtol=1e-5, atol=1e-4)
            torch.testing.assert_close(out["final_hidden"][a:b], final, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_in_bf16_ours_is_as_near_the_fp32_states_as_transformers_own_bf16(made, family):
    """bf16 rounding, which expert choices near a tie amplify: our bf16 states stand as far from transformers' fp32
    ones as its own bf16 run does (0.6% for Qwen3-MoE to ~10% for gpt-oss's sinks and clamps at these sizes)."""
    path, ids = made(family), torch.randint(0, 256, (200,), generator=torch.Generator().manual_seed(1))
    exact = _reference(path, ids, [0])[1]
    theirs = _reference(path, ids, [0], torch.bfloat16)[1].float()
    ours = TargetRunner(Checkpoint(path), [0, 1, 2], CPU, torch.bfloat16).run(ids, [0, 200])["final_hidden"].float()
    error = {name: float((x - exact).norm() / exact.norm()) for name, x in (("ours", ours), ("theirs", theirs))}
    assert error["ours"] <= 2 * error["theirs"] + 0.01, error


def test_heads_wider_than_the_hidden_size_as_glm_publishes_them(tmp_path):
    """GLM-4.5 to 4.7: 96 heads of 128 over a hidden size of 5120 (not a multiple of 96), here 6 heads of 16 over 64;
    GLM-4.7-Flash's MLA: 20 heads over 2048. Both are read, and the GQA forward equals transformers'."""
    path = tiny.make_moe(tmp_path / "glm", "glm4_moe", heads=6, kv_heads=2)
    ids = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(3))
    out = TargetRunner(Checkpoint(path), [0, 1, 2], CPU, torch.float32).run(ids, [0, 40])
    aux, final = _reference(path, ids, [0, 1, 2])
    torch.testing.assert_close(out["aux_hidden"], aux, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(out["final_hidden"], final, rtol=1e-5, atol=1e-4)
    flash = {"model_type": "glm4_moe_lite", "hidden_size": 2048, "num_attention_heads": 20, "num_key_value_heads": 20,
             "vocab_size": 154880, "num_hidden_layers": 47, "intermediate_size": 10240, "rms_norm_eps": 1e-5,
             "q_lora_rank": 768, "kv_lora_rank": 512, "qk_nope_head_dim": 192, "qk_rope_head_dim": 64,
             "v_head_dim": 256, "n_routed_experts": 64, "num_experts_per_tok": 4, "moe_intermediate_size": 1536}
    (tmp_path / "config.json").write_text(json.dumps(flash))
    assert Checkpoint(tmp_path, require_weights=False).config.family.name == "GLM-4.7-Flash"


@pytest.mark.parametrize("family", ["minimax_m2", "gpt_oss"])
def test_decoding_with_caches_equals_the_whole_forward(made, family):
    """The KV-cache path (evaluate, generate): sinks and the window hold across pieces of every size."""
    path = made(family)
    target = IncrementalTarget(Checkpoint(path), [0, 1, 3], CPU)
    ids = torch.randint(0, 256, (200,), generator=torch.Generator().manual_seed(2))
    cache = target.new_cache()
    parts = [target.forward_many([ids[a:b]], [cache])[0] for a, b in ((0, 100), (100, 101), (101, 140), (140, 200))]
    whole = TargetRunner(Checkpoint(path), [0, 1, 3], CPU, torch.float32).run(ids, [0, 200])
    torch.testing.assert_close(torch.cat([p[0] for p in parts]), whole["aux_hidden"], rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(torch.cat([p[1] for p in parts]), whole["final_hidden"], rtol=1e-5, atol=1e-4)


def _mxfp4_by_hand(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """The OCP e2m1 rule bit by bit: sign, two exponent bits, one mantissa bit; subnormal at exponent 0."""
    out = np.empty(blocks.shape[:-1] + (32,), dtype=np.float64)
    for idx in np.ndindex(blocks.shape[:-1]):
        for j, byte in enumerate(blocks[idx]):
            for half, nib in enumerate((byte & 0xF, byte >> 4)):
                sign, exp, man = -1.0 if nib & 8 else 1.0, (nib >> 1) & 3, nib & 1
                value = man * 0.5 if exp == 0 else (1 + man * 0.5) * 2.0 ** (exp - 1)
                out[idx + (2 * j + half,)] = sign * value * 2.0 ** (int(scales[idx]) - 127)
    return out.reshape(*blocks.shape[:-2], -1)


def test_mxfp4_dequantizes_by_the_e2m1_rule_and_runs_as_its_dense_weights(made):
    g = torch.Generator().manual_seed(3)
    blocks = torch.randint(0, 256, (2, 3, 2, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(110, 140, (2, 3, 2), generator=g, dtype=torch.uint8)
    expect = torch.from_numpy(_mxfp4_by_hand(blocks.numpy(), scales.numpy()))
    assert torch.equal(quant.dequantize_mxfp4(blocks, scales, torch.float64), expect)
    # the MXFP4 release and the bf16 one (its dequantization, transposed as transformers stores it) run alike
    packed, dense = Checkpoint(made("gpt_oss", "mxfp4")), Checkpoint(made("gpt_oss"))
    assert packed.info("layers.0.mlp.experts.gate_up_proj_blocks")["dtype"] == "U8"
    ids = torch.randint(0, 256, (40,), generator=g)
    a, b = (TargetRunner(c, [0, 1, 2], CPU, torch.float32).run(ids, [0, 40]) for c in (packed, dense))
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-6, atol=1e-6)
    report = inspect(str(packed.dir))   # gate_up and down of each of the 4 layers
    assert report["weights"]["quantized_linears"]["mxfp4"] == 8 and report["quantization"] == {"method": "mxfp4"}


@pytest.mark.parametrize("family", FAMILIES)
def test_inspect_names_the_family_and_its_parts(made, family):
    report = inspect(str(made(family)))
    mtp = [n for n in Checkpoint(made(family)).weight_map if n.startswith("model.layers.4.")]   # GLM's MTP layer
    assert report["family"] == NAMES[family] and report["weights"]["skipped_tensors"] == len(mtp)
    assert bool(mtp) == (family == "glm4_moe")
    router = {"qwen3_moe": "softmax", "minimax_m2": "sigmoid", "glm4_moe": "sigmoid", "gpt_oss": "topk_softmax"}
    assert report["moe"]["router"] == router[family] and report["moe"]["routed_experts"] == 8
    attention = report["attention"]
    assert attention["rotary_dim"] == (8 if family in ("minimax_m2", "glm4_moe") else 16)
    assert attention["qk_norm"] == {"minimax_m2": "whole", "gpt_oss": None}.get(family, "head")
    assert (attention["sinks"], attention["sliding_window"]) == ((True, 128) if family == "gpt_oss" else (False, 0))


def test_a_gpt_oss_config_without_its_window_reads_the_config_classs_128(made, tmp_path):
    from transformers import GptOssConfig
    target = tmp_path / "t"
    shutil.copytree(made("gpt_oss"), target)
    raw = json.loads((target / "config.json").read_text())
    del raw["sliding_window"]
    (target / "config.json").write_text(json.dumps(raw))
    assert inspect(str(target))["attention"]["sliding_window"] == GptOssConfig().sliding_window == 128


def test_minimax_m2s_multi_token_prediction_layers_are_skipped(made, tmp_path):
    """MiniMax-M2's releases may carry `num_mtp_modules` layers at indices L on, which vLLM 0.34's minimax_m2.py
    (hf_to_vllm_mapper) and SGLang 0.5.23's (get_spec_layer_idx_from_weight_name) drop: skipped, not refused."""
    from safetensors.torch import load_file, save_file
    path = made("minimax_m2")
    tensors = {n: t for f in sorted(path.glob("*.safetensors")) for n, t in load_file(f).items()}
    mtp = {"model.layers.4." + n[15:]: t.clone() for n, t in tensors.items() if n.startswith("model.layers.3.")}
    save_file({**tensors, **mtp}, tmp_path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_mtp_modules": 1}))
    report = inspect(str(tmp_path))
    assert report["weights"]["skipped_tensors"] == len(mtp) and "num_mtp_modules 1" in next(iter(
        report["weights"]["skipped"]))


# The engines' default captures, as layer inputs: SGLang 0.5.23 srt/models/{qwen3_moe,minimax_m2,glm4_moe,gpt_oss}.py
# set_eagle3_layers_to_capture: [2, num_layers // 2, num_layers - 3] in each; vLLM 0.34's SupportsEagle3 default
# (model_executor/models/interfaces.py get_eagle3_aux_hidden_state_layers): (2, num_layers // 2, num_layers - 3).
ENGINE_RULE = {"sglang": {f: lambda n: [2, n // 2, n - 3] for f in FAMILIES},
               "vllm": {f: lambda n: [2, n // 2, n - 3] for f in FAMILIES}}
# the published targets' depths: Qwen3-235B-A22B 94, Qwen3-30B-A3B 48, MiniMax-M2 62, GLM-4.5 92, gpt-oss 24 / 36
DEPTHS = {"qwen3_moe": (94, 48), "minimax_m2": (62,), "glm4_moe": (92, 46), "gpt_oss": (24, 36)}


@pytest.mark.parametrize("family", FAMILIES)
def test_default_aux_layers_are_what_each_engine_captures(made, family, tmp_path):
    config = json.loads((made(family) / "config.json").read_text())
    for depth in DEPTHS[family]:
        (tmp_path / "config.json").write_text(json.dumps({**config, "num_hidden_layers": depth}))
        ours = Checkpoint(tmp_path, require_weights=False).config.default_aux_layer_ids()
        for engine, rule in ENGINE_RULE.items():   # the engines count layer inputs, we count outputs
            assert [i + 1 for i in ours] == rule[family](depth), (engine, depth)


def _export_random_draft(path, tmp_path, formats=None) -> dict:
    """A random draft resolved for target `path`, saved as a checkpoint and exported -> {format: folder}."""
    from safetensors.torch import save_file
    from eagle3.draft import Eagle3Draft
    from eagle3.export import export_all
    from eagle3.resolve import resolve
    cfg = make_config(tmp_path, path, path / "config.json", **({"export.formats": formats} if formats else {}))
    target = Checkpoint(path)
    resolved = resolve(cfg, target)
    draft = Eagle3Draft(resolved.draft_spec)
    draft.t2d[:resolved.draft_spec.draft_vocab_size] = True
    ckpt = tmp_path / "checkpoint"
    ckpt.mkdir()
    save_file({k: v.contiguous() for k, v in draft.state_dict().items()}, ckpt / "model.safetensors")
    (ckpt / "state.json").write_text(json.dumps({
        "config": cfg.to_dict(), "resolved": resolved.to_dict(), "target": target.config.identity(),
        "target_architectures": target.config.architectures}))
    return export_all(ckpt, tmp_path / "export", cfg)


@pytest.mark.parametrize("family", ["glm4_moe", "qwen3_moe"])
def test_the_default_exports_are_those_the_engines_serve_for_the_family(made, family, tmp_path, capsys):
    """vLLM 0.34.0's Glm4MoeForCausalLM lacks SupportsEagle3: its export is skipped with the reason, SGLang's written."""
    written = _export_random_draft(made(family), tmp_path)
    skipped = "not exporting vllm: vLLM 0.34.0 serves no EAGLE-3 draft for a glm4_moe target: its Glm4MoeForCausalLM"
    if family == "glm4_moe":
        assert set(written) == {"sglang"} and skipped in capsys.readouterr().out
        assert not (tmp_path / "export" / "vllm").exists()
    else:
        assert set(written) == {"vllm", "sglang"} and "not exporting" not in capsys.readouterr().out


def test_a_vllm_export_named_for_a_target_vllm_does_not_serve_is_refused(made, tmp_path):
    from eagle3.export import ExportError
    with pytest.raises(ExportError, match=r"vLLM 0.34.0 serves no EAGLE-3 draft for a glm4_moe target: .*"
                                          r'SupportsEagle3; export sglang only \(export.formats = \["sglang"\]\)'):
        _export_random_draft(made("glm4_moe"), tmp_path, '["vllm"]')
    assert not (tmp_path / "export").exists()


def test_the_docs_table_of_what_each_engine_serves_is_the_codes():
    """docs/families.md's vLLM / SGLang columns against config.UNSERVED: "**no**" exactly for the families listed."""
    import re
    from pathlib import Path
    from eagle3.config import ENGINES, UNSERVED
    text = (Path(__file__).resolve().parents[1] / "docs" / "families.md").read_text()
    header = next(line for line in text.splitlines() if line.startswith("| family"))
    columns = [c.strip() for c in header.split("|")[1:-1]]
    lines = text[text.index(header):].splitlines()[2:]
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in lines[:lines.index("")]]
    for fmt in ENGINES:
        column = columns.index(f"{ENGINES[fmt]} EAGLE-3")
        for row in rows:
            types = set(re.findall(r"`(\w+)`", row[0]))
            assert row[column].startswith("**no**" if types & set(UNSERVED[fmt]) else "yes"), (fmt, row[0])
            assert not types & set(UNSERVED[fmt]) or types <= set(UNSERVED[fmt])


@pytest.mark.parametrize("family", FAMILIES)
def test_train_export_and_decode_losslessly(made, family, tmp_path, capsys):
    """Extract, train a few steps, export for vLLM (GLM-4.5: the default formats, of which vLLM 0.34's is skipped
    at start-up) and decode with the vLLM export (GLM-4.5: the checkpoint; the SGLang layout is not read back):
    token for token the target's."""
    data = tiny.make_token_data(tmp_path / "data.jsonl", vocab=256, sequences=24, max_len=48)
    fmt = "sglang" if family == "glm4_moe" else "vllm"
    cfg = make_config(tmp_path, made(family), data, **{
        "train.max_steps": 3, "train.eval_every": 3, "train.checkpoint_every": 3,
        **({} if family == "glm4_moe" else {"export.formats": '["vllm"]'}),
        "debug.evaluate_device": "cpu", "evaluate.max_new_tokens": 8, "train.ttt_steps": 2})
    extraction.run(cfg)
    training.run(cfg)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(line + "\n" for line in data.read_text().splitlines()[:3]))
    assert (tmp_path / "train" / "export" / fmt / "model.safetensors").exists()
    assert (tmp_path / "train" / "export" / "vllm").exists() == (fmt == "vllm")
    assert ("not exporting vllm: vLLM 0.34.0 serves no EAGLE-3 draft" in capsys.readouterr().err) == (fmt != "vllm")
    draft = tmp_path / "train" / "export" / "vllm" if fmt == "vllm" else train_state.latest(tmp_path / "train")
    report = real_decoding(cfg, draft, prompts)
    assert report["mismatches"] == 0 and report["prompts"] == 3 and report["rounds"] >= 3


def test_the_gpt_oss_drafts_rotary_is_its_targets_yarn(made, tmp_path):
    """YaRN factor 32 over 4,096 positions with the untruncated ramp, exported as both engines read it."""
    from eagle3.models.families import build_model
    from eagle3.ops import draft_rope
    from eagle3.resolve import resolve
    path = made("gpt_oss")
    spec = resolve(make_config(tmp_path, path, path / "config.json"), Checkpoint(path)).draft_spec
    assert spec.rope_scaling == {"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096,
                                 "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False}
    target = build_model(Checkpoint(path), CPU, torch.float32)
    inv_freq, scale = draft_rope(spec.head_dim, spec.rope_theta, spec.rope_scaling)
    assert torch.equal(inv_freq, target.inv_freq) and scale == target.rope_scale == pytest.approx(1.3466, abs=1e-4)


def test_a_chunked_gpt_oss_sequence_allocates_nothing_larger_than_its_hidden_states(made):
    """768 tokens in 128-token chunks past the window: the window's keys and the sink key add no [T, T] mask
    nor anything larger than h [T, H]; the whole-sequence forward does ([T * 2, H] MoE pairs)."""
    from test_long_target import peaks_chunked_and_whole
    from eagle3.models.streaming import build_model
    T = 768
    peaks, outs, h = peaks_chunked_and_whole(build_model(Checkpoint(made("gpt_oss")), CPU, torch.float32), T)
    assert peaks[128] <= h.nbytes < peaks[T], (peaks, h.nbytes)
    torch.testing.assert_close(outs[128], outs[T], rtol=1e-5, atol=1e-4)


def _dequantized_copy(path, out):
    """The fp8 checkpoint at `path` with every block-quantized linear dequantized by hand (weight x its block's
    scale_inv, in fp32) and no quantization_config: what the fp8 forward must equal."""
    from safetensors import safe_open
    from safetensors.torch import save_file
    config = json.loads((path / "config.json").read_text())
    b0, b1 = config.pop("quantization_config")["weight_block_size"]
    stored = {}
    for file in sorted(set(Checkpoint(path).weight_map.values())):
        with safe_open(path / file, "pt") as f:
            stored.update({name: f.get_tensor(name) for name in f.keys()})
    tensors = {}
    for name, t in stored.items():
        scale = stored.get(name[:-len("weight")] + "weight_scale_inv") if name.endswith(".weight") else None
        if scale is not None:
            t = t.float() * scale.float().repeat_interleave(b0, 0)[:t.shape[0]].repeat_interleave(b1, 1)[:, :t.shape[1]]
        if not name.endswith(".weight_scale_inv"):
            tensors[name] = t
    out.mkdir()
    (out / "config.json").write_text(json.dumps(config))
    save_file(tensors, out / "model.safetensors")
    return out


@pytest.mark.parametrize("family", ["qwen3_moe", "minimax_m2", "glm4_moe"])
def test_fp8_block_checkpoints_run_as_their_dequantized_weights(made, family, tmp_path):
    """The FP8 releases' layout (128 x 128 blocks there, 16 x 32 here: several blocks and partial ones), whole and
    chunked, against the same weights dequantized by hand."""
    fp8 = made(family, "fp8")
    assert Checkpoint(fp8).info("layers.1.self_attn.q_proj.weight")["dtype"] == "F8_E4M3"
    dense = _dequantized_copy(fp8, tmp_path / "dense")
    ids = torch.randint(0, 256, (60,), generator=torch.Generator().manual_seed(4))
    ref = TargetRunner(Checkpoint(dense), [0, 1, 2], CPU, torch.float32).run(ids, [0, 60])
    for chunk in (1000, 16):
        out = TargetRunner(Checkpoint(fp8), [0, 1, 2], CPU, torch.float32, chunk_tokens=chunk).run(ids, [0, 60])
        for key in ("aux_hidden", "final_hidden"):
            torch.testing.assert_close(out[key], ref[key], rtol=1e-5, atol=1e-5)
    assert inspect(str(fp8))["weights"]["quantized_linears"]["fp8"] > 0


def test_the_staged_target_gives_the_runners_states(made):
    """`train.online_target = "staged"` (one stage here): gpt-oss's sinks and windows through its pipeline."""
    from eagle3.models.staged import StagedTarget
    ckpt, cu = Checkpoint(made("gpt_oss")), [0, 140, 200]
    ids = torch.randint(0, 256, (200,), generator=torch.Generator().manual_seed(6))
    staged = StagedTarget(ckpt, [0, 1, 2], CPU, torch.float32, rank=0, world=1, chunk_tokens=64).run([(ids, cu)], None)
    whole = TargetRunner(ckpt, [0, 1, 2], CPU, torch.float32).run(ids, cu)
    for key in whole:
        torch.testing.assert_close(staged[0][key], whole[key], rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("window", [0, 5])
def test_window_and_sink_attention_equal_the_softmax_written_out(window, monkeypatch):
    """gpt-oss's eager attention (transformers: the sink a logit beside the keys', dropped after the softmax) against
    `cached_attention` with query blocks smaller than the window and the sequence (its blocked path)."""
    from eagle3.models import attention
    monkeypatch.setattr(attention, "WINDOW_BLOCK", 3)
    g = torch.Generator().manual_seed(8)
    n, T, Hq, Hkv, D = 17, 11, 4, 2, 8
    q, k, v = torch.randn(T, Hq, D, generator=g), torch.randn(n, Hkv, D, generator=g), torch.randn(n, Hkv, D, generator=g)
    sinks = torch.randn(Hq, generator=g)
    scores = torch.einsum("thd,shd->hts", q, k.repeat_interleave(2, 1)) * D ** -0.5              # [Hq, T, n]
    back = torch.arange(n - T, n)[:, None] - torch.arange(n)[None]
    scores = scores.masked_fill((back < 0) | ((back >= window) if window else False), float("-inf"))
    probs = torch.cat([scores, sinks[:, None, None].expand(Hq, T, 1)], -1).softmax(-1)[..., :-1]
    expect = torch.einsum("hts,shd->thd", probs, v.repeat_interleave(2, 1))
    torch.testing.assert_close(attention.cached_attention(q, k, v, None, window, sinks), expect, rtol=1e-5, atol=1e-5)
