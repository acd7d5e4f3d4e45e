"""The MLA families beside DeepSeek-V3: GLM-4.7-Flash (`glm4_moe_lite`), DeepSeek-V3.2 (`deepseek_v32`) and GLM-5
(`glm_moe_dsa`), on tiny random checkpoints that transformers 5.24's own classes write (real names and nesting): our
auxiliary and final hidden states equal theirs, whole, chunked and streamed, past the indexer's top-k; the DSA
selection exactly; the families the forward does not build refused in one line."""
from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import make_config
from eagle3 import extraction, train_state, training
from eagle3.evaluate import real_decoding
from eagle3.models import indexer, tiny
from eagle3.models.incremental import IncrementalTarget
from eagle3.models.inspect import inspect
from eagle3.models.staged import StagedTarget
from eagle3.models.streaming import TargetRunner
from eagle3.models.weights import Checkpoint, TargetError, read_config

transformers = pytest.importorskip("transformers")

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2,
            n_shared_experts=1, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
            v_head_dim=16, first_k_dense_replace=1, rms_norm_eps=1e-5, n_group=2, topk_group=1)
# 16 indexer heads: a key whose score is an exact 0 (ReLU on every head) at the top-k cut, a tie transformers' topk
# breaks its own way, comes once in ~65,000 keys
DSA = dict(index_topk=16, index_n_heads=16, index_head_dim=32)
FAMILIES = {
    "glm4_moe_lite": TINY,
    "glm4_moe_lite_halves": {**TINY, "rope_interleave": False},
    "deepseek_v32": {**TINY, **DSA, "rope_parameters": {
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32,
        "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}},
    "glm_moe_dsa": {**TINY, **DSA, "indexer_types": ["full", "shared", "full", "shared"]},
}


def _transformers_target(out: Path, name: str, seed: int = 0, **overrides):
    """A tiny random model of family `name` saved by transformers (config.json + model.safetensors) -> the model."""
    kw = {**FAMILIES[name], **overrides}
    cfg = transformers.AutoConfig.for_model(name.removesuffix("_halves").removesuffix("_long"), **kw)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
    with torch.no_grad():   # norms, router bias and LayerNorm away from their initial ones: each must be read right
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif n.endswith(("k_norm.bias", "e_score_correction_bias")):
                p.normal_(0, 0.1)
            elif p.dim() > 1 or n.endswith("gate.weight"):
                p.normal_(0, 0.1)
        for n, b in model.named_buffers():
            if n.endswith("e_score_correction_bias"):
                b.normal_(0, 0.1)
    model.save_pretrained(out)
    return model


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(request.param)
    return request.param, out, _transformers_target(out, request.param)


def _close(got: torch.Tensor, want: torch.Tensor, tol: float = 1e-4) -> None:
    """Equal up to fp32 rounding of the sums (transformers' order of operations is not ours): relative to the scale."""
    err = float((got.float() - want).abs().max())
    assert err <= tol * float(want.abs().max()), err


def _reference(model, ids: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
    """transformers' outputs of every layer and the final normed state of one sequence ids [T]."""
    with torch.no_grad():
        out = model.model(input_ids=ids[None], output_hidden_states=True)
    return [h[0] for h in out.hidden_states[1:-1]], out.last_hidden_state[0]


@pytest.mark.parametrize("chunk", [4096, 24])
def test_hidden_states_equal_transformers_past_the_top_k(family, chunk):
    """64 tokens against a top-k of 16: three quarters of the queries attend sparsely; whole and in chunks of 24."""
    name, path, model = family
    ids = torch.randint(0, 128, (64,), generator=torch.Generator().manual_seed(1))
    layers, final = _reference(model, ids)
    aux = [0, 1, 2]
    runner = TargetRunner(Checkpoint(path), aux, torch.device("cpu"), torch.float32, chunk_tokens=chunk)
    out = runner.run(ids, [0, 64])
    got = out["aux_hidden"].view(64, 3, -1)
    for j, i in enumerate(aux):
        _close(got[:, j], layers[i])
    _close(out["final_hidden"], final)


def test_row_blocks_of_one_query_give_the_same_states(family, monkeypatch):
    """The index scores and the masked attention a query row at a time (BLOCK_ELEMENTS 1) change nothing."""
    name, path, model = family
    monkeypatch.setattr(indexer, "BLOCK_ELEMENTS", 1)
    ids = torch.randint(0, 128, (40,), generator=torch.Generator().manual_seed(7))
    runner = TargetRunner(Checkpoint(path), [1, 2, 3], torch.device("cpu"), torch.float32, chunk_tokens=16)
    _close(runner.run(ids, [0, 40])["final_hidden"], _reference(model, ids)[1])


def test_a_chunked_dsa_sequence_allocates_nothing_larger_than_its_hidden_states(family, monkeypatch):
    """768 tokens in chunks of 128 against a top-k of 16, index scores a query row at a time: the indexer's keys
    [T, 32], the kept choices [T, 16] and each block's scores and mask stay below h [T, H], or a chunk's indexer
    queries [128, 16 x 32] (wider than the tiny hidden size); no [T, T] anywhere."""
    from test_long_target import peaks_chunked_and_whole
    name, path, _ = family
    if "index_topk" not in FAMILIES[name]:
        pytest.skip("the DSA families (the chunked MLA forward: test_long_target.py)")
    monkeypatch.setattr(indexer, "BLOCK_ELEMENTS", 16 * 768)
    T = 768
    peaks, outs, h = peaks_chunked_and_whole(TargetRunner(Checkpoint(path), [1], torch.device("cpu"),
                                                          torch.float32).model, T)
    queries = 128 * DSA["index_n_heads"] * DSA["index_head_dim"] * 4
    assert peaks[128] <= max(h.nbytes, queries) < peaks[T], (peaks, h.nbytes)
    _close(outs[128], outs[T])


def test_staged_target_gives_the_same_states(family):
    """The staged online target (one stage here) runs the same layers: past the top-k, in chunks of 24."""
    name, path, model = family
    ids = torch.randint(0, 128, (64,), generator=torch.Generator().manual_seed(1))
    staged = StagedTarget(Checkpoint(path), [1, 2, 3], torch.device("cpu"), torch.float32, 0, 1, chunk_tokens=24)
    _close(staged.run([(ids, [0, 64])], None)[0]["final_hidden"], _reference(model, ids)[1])


def test_packed_sequences_each_attend_to_their_own(family):
    """Two sequences packed (one past the top-k, one within) equal each run alone."""
    name, path, model = family
    g = torch.Generator().manual_seed(2)
    a, b = torch.randint(0, 128, (40,), generator=g), torch.randint(0, 128, (12,), generator=g)
    runner = TargetRunner(Checkpoint(path), [1, 2, 3], torch.device("cpu"), torch.float32)
    both = runner.run(torch.cat([a, b]), [0, 40, 52])["final_hidden"]
    _close(both[:40], _reference(model, a)[1])
    _close(both[40:], _reference(model, b)[1])


def test_decoding_with_caches_equals_the_whole_forward_past_the_top_k(family):
    """Two sequences decoded together a few tokens a pass (the indexer's keys kept beside the KV cache) to 40
    positions against a top-k of 16, and one prefilled in a single pass of 70 (over SHORT_MAX)."""
    name, path, model = family
    g = torch.Generator().manual_seed(5)
    seqs = [torch.randint(0, 128, (n,), generator=g) for n in (40, 33, 70)]
    target = IncrementalTarget(Checkpoint(path), [1, 2, 3], torch.device("cpu"))
    caches = [target.new_cache() for _ in seqs]
    got = [[], [], []]
    for a, b in ((0, 11), (11, 12), (12, 20), (20, 21), (21, 33), (33, 40)):
        live = [i for i in range(2) if a < len(seqs[i])]
        outs = target.forward_many([seqs[i][a:b] for i in live], [caches[i] for i in live])
        for i, (aux, final) in zip(live, outs):
            got[i].append(final)
    got[2] = [target.forward_many([seqs[2]], [caches[2]])[0][1]]
    for seq, parts in zip(seqs, got):
        _close(torch.cat(parts), _reference(model, seq)[1])


def test_bf16_hidden_states_within_rounding(family):
    """In bf16 as served, within the top-k (every key chosen: no selection to flip on a rounding): our distance to
    the fp32 states is that of transformers' own bf16 run (mean over the tokens: a rounding may flip an expert)."""
    name, path, model = family
    ids = torch.randint(0, 128, (16,), generator=torch.Generator().manual_seed(3))
    _, final = _reference(model, ids)
    _, theirs = _reference(copy.deepcopy(model).to(torch.bfloat16), ids)
    runner = TargetRunner(Checkpoint(path), [1, 2, 3], torch.device("cpu"), torch.bfloat16)
    ours = runner.run(ids, [0, 16])["final_hidden"]
    assert ours.dtype == torch.bfloat16
    assert (ours.float() - final).abs().mean() <= 1.5 * (theirs.float() - final).abs().mean()


def test_selection_is_the_top_k_of_the_index_scores():
    """`indexer.select` against the scores written out: Σ_h w_h relu(q_h · k / sqrt(D)), causal, top-k."""
    g = torch.Generator().manual_seed(0)
    q, keys, w = torch.randn(20, 3, 8, generator=g), torch.randn(20, 8, generator=g), torch.randn(20, 3, generator=g)
    positions = torch.arange(20)
    chosen = indexer.select(q, w, keys, positions, 5)
    for t in range(5, 20):
        scores = [sum(w[t, h] * max(0.0, float(q[t, h] @ keys[j]) / 8 ** 0.5) for h in range(3)) for j in range(t + 1)]
        best = sorted(range(t + 1), key=lambda j: -scores[j])[:5]
        assert sorted(chosen[t].tolist()) == sorted(best)


def test_shared_dsa_layers_have_no_indexer_and_reuse_the_full_ones(family):
    name, path, _ = family
    if name != "glm_moe_dsa":
        pytest.skip("GLM-5's layers only")
    report = inspect(str(path))
    assert report["family"] == "GLM-5" and report["indexer"]["layer_types"] == ["full", "shared", "full", "shared"]
    ckpt = Checkpoint(path)
    assert ckpt.has("layers.0.self_attn.indexer.wk.weight") and not ckpt.has("layers.1.self_attn.indexer.wk.weight")
    assert report["weights"]["forward_tensors"] == report["weights"]["tensors"]   # every tensor read


def test_a_shared_layer_without_its_full_layer_is_refused(family):
    """A stage that starts on a 'shared' GLM-5 layer has no keys to reuse past the top-k: one line naming the layer."""
    name, path, _ = family
    if name != "glm_moe_dsa":
        pytest.skip("GLM-5's layers only")
    model = TargetRunner(Checkpoint(path), [1, 2, 3], torch.device("cpu"), torch.float32).model
    h = torch.randn(40, 64)
    with pytest.raises(TargetError, match="reuses the keys layer 0 chose, which did not run before it here"):
        model.layer_forward(model.load_layer(1), h, torch.arange(40), torch.tensor([0, 40]))


def test_the_published_mtp_layer_is_skipped_for_its_reason(family, tmp_path):
    """The releases carry one multi-token-prediction layer at index L (num_nextn_predict_layers 1; with GLM-5's and
    DeepSeek-V3.2's an indexer of its own): read by no forward, counted as skipped, the states unchanged."""
    name, path, model = family
    tensors = load_file(path / "model.safetensors")
    last = f"model.layers.{TINY['num_hidden_layers'] - 1}."
    mtp = {"model.layers.4." + n[len(last):]: t.clone() for n, t in tensors.items() if n.startswith(last)}
    mtp.update({"model.layers.4." + n[15:]: t.clone() for n, t in tensors.items()
                if n.startswith("model.layers.0.self_attn.indexer.")})
    mtp.update({f"model.layers.4.{n}": torch.ones(64) for n in ("enorm.weight", "hnorm.weight", "shared_head.norm.weight")})
    mtp["model.layers.4.eh_proj.weight"] = torch.zeros(64, 128)
    save_file({**tensors, **mtp}, tmp_path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    report = inspect(str(tmp_path))
    assert report["weights"]["skipped_tensors"] == len(mtp) and len(report["weights"]["skipped"]) == 1
    ids = torch.randint(0, 128, (24,), generator=torch.Generator().manual_seed(8))
    runner = TargetRunner(Checkpoint(tmp_path), [1, 2, 3], torch.device("cpu"), torch.float32)
    _close(runner.run(ids, [0, 24])["final_hidden"], _reference(model, ids)[1])


def test_inspect_names_each_family(family):
    name, path, _ = family
    report = inspect(str(path))
    assert report["family"] == {"glm4_moe_lite": "GLM-4.7-Flash", "glm4_moe_lite_halves": "GLM-4.7-Flash",
                                "deepseek_v32": "DeepSeek-V3.2", "glm_moe_dsa": "GLM-5"}[name]
    assert report["aux_layer_ids"] == [1, 1, 0]   # [1, L//2 - 1, L - 4] at L = 4
    assert report["weights"]["forward_tensors"] == report["weights"]["tensors"]   # every tensor read


@pytest.mark.parametrize("edit, error", [
    ({"index_topk": 0}, "index_topk 0 and index_head_dim 32; expected a top-k of at least 1"),
    ({"indexer_types": ["full", "shared"]}, "indexer_types ['full', 'shared']; expected 'full' or 'shared' for each"),
    ({"indexer_types": ["shared", "full", "full", "full"]}, "indexer_types[0] = 'shared'; the first layer must be"),
    ({"mlp_layer_types": ["dense", "moe", "sparse", "sparse"]}, "mlp_layer_types ['dense', 'moe', 'sparse', 'sparse']"),
    ({"attention_bias": True}, "attention_bias true is not supported")])
def test_bad_dsa_fields_are_refused_naming_them(tmp_path, edit, error):
    raw = {**TINY, **DSA, "model_type": "glm_moe_dsa", **edit}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(TargetError, match=f"config.json: {re.escape(error)}"):
        inspect(str(tmp_path))


@pytest.mark.parametrize("model_type, missing", [
    ("qwen3_5_moe", "Gated DeltaNet"), ("deepseek_v4", "hyper-connections"), ("kimi_linear", "Kimi Delta Attention")])
def test_families_not_built_are_refused_naming_what_is_missing(tmp_path, model_type, missing):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": model_type, "hidden_size": 64}))
    with pytest.raises(TargetError) as e:
        read_config(path)
    assert str(e.value).startswith(f"{path}: model_type '{model_type}' is not supported: ") and missing in str(e.value)
    assert "\n" not in str(e.value)


def test_qwen3_5_moe_is_refused_by_its_nested_text_config_too(tmp_path):
    """Qwen3.5-MoE's config.json nests a `qwen3_5_moe_text` text_config (transformers 5.24 `Qwen3_5MoeConfig`)."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "qwen3_5_moe", "text_config": {"model_type": "qwen3_5_moe_text"}}))
    with pytest.raises(TargetError, match=r"text_config: model_type 'qwen3_5_moe_text' is not supported: Qwen3.5-MoE: "
                                          "its Gated DeltaNet"):
        read_config(path)


@pytest.mark.slow
def test_past_2048_tokens_with_the_published_top_k(tmp_path, name="glm_moe_dsa"):
    """index_topk 2,048 as published, 2,100 tokens in chunks of 1,024: the last 52 queries of each layer attend
    sparsely (the second layer with the first's keys; DeepSeek-V3.2's indexer differs only in its rotary, tested
    past a top-k of 16 above); transformers runs the first two layers only."""
    FAMILIES[f"{name}_long"] = {**FAMILIES[name], "index_topk": 2048}
    try:
        model = _transformers_target(tmp_path, f"{name}_long")
    finally:
        del FAMILIES[f"{name}_long"]
    ids = torch.randint(0, 128, (2100,), generator=torch.Generator().manual_seed(4))
    model.model.layers = model.model.layers[:2]
    seen = []
    for layer in model.model.layers:
        layer.register_forward_hook(lambda m, i, o: seen.append((o[0] if isinstance(o, tuple) else o)[0]))
    with torch.no_grad():
        model.model(input_ids=ids[None])
    runner = TargetRunner(Checkpoint(tmp_path), [0, 1, 2], torch.device("cpu"), torch.float32, chunk_tokens=1024)
    got = runner.run(ids, [0, 2100])["aux_hidden"].view(2100, 3, -1)
    _close(got[:, 0], seen[0])
    _close(got[:, 1], seen[1])


# the engines' rules for the layers an EAGLE-3 target captures (both count layer inputs; ours count outputs):
# vLLM 0.34 `SupportsEagle3` default (2, L // 2, L - 3); SGLang 0.5.23 deepseek_v2.py / glm4_moe_lite.py
# `set_eagle3_layers_to_capture`: the draft's ids + 1 when the first id is 1, else the ids as given
def vllm_default(layers: int) -> list[int]:
    return [2, layers // 2, layers - 3]


def sglang_captures(ids: list[int]) -> list[int]:
    return [i + 1 for i in ids] if ids and ids[0] == 1 else list(ids)


@pytest.mark.parametrize("model_type, layers", [("glm4_moe_lite", 47), ("deepseek_v32", 61), ("glm_moe_dsa", 78)])
def test_default_aux_layers_are_what_the_engines_capture(tmp_path, model_type, layers):
    """At the published depths (GLM-4.7-Flash 47, DeepSeek-V3.2 61, GLM-5 78): our outputs of layers i are the
    inputs of layers i + 1 that vLLM captures by default and SGLang captures from the exported ids."""
    raw = {**TINY, **DSA, "model_type": model_type, "num_hidden_layers": layers, "index_topk": 2048}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    ours = read_config(tmp_path / "config.json").default_aux_layer_ids()
    assert [i + 1 for i in ours] == vllm_default(layers) == sglang_captures(ours)


@pytest.mark.parametrize("name", ["glm4_moe_lite", "deepseek_v32", "glm_moe_dsa"])
def test_train_export_evaluate_is_lossless(tmp_path, name):
    """A draft trained briefly on each family's tiny target, exported for both engines: real greedy decoding through
    the vLLM export (GLM-4.7-Flash: the checkpoint, as vLLM 0.34 serves it no EAGLE-3 draft and the export skips it)
    reproduces the target's own greedy tokens (prompts and replies within the DSA top-k of 64)."""
    target = tmp_path / "target"
    _transformers_target(target, name, **({"index_topk": 64} if name != "glm4_moe_lite" else {}))
    data = tiny.make_token_data(tmp_path / "data.jsonl", vocab=128, sequences=16, min_len=8, max_len=24)
    cfg = make_config(tmp_path, target, data, **{
        "vocab.draft_vocab_size": 64, "train.max_steps": 3, "train.eval_every": 3, "train.checkpoint_every": 3,
        "export.formats": '["vllm", "sglang"]', "debug.export_dtype": "float32", "debug.evaluate_device": "cpu",
        "evaluate.max_new_tokens": 12})
    extraction.run(cfg)
    training.run(cfg)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(data.read_text().splitlines(keepends=True)[:4]))
    vllm = Path(cfg.train.output_dir) / "export" / "vllm"
    assert vllm.exists() == (name != "glm4_moe_lite")
    report = real_decoding(cfg, vllm if vllm.exists() else train_state.latest(Path(cfg.train.output_dir)), prompts)
    assert report["mismatches"] == 0 and report["prompts"] == 4
    sglang = json.loads((Path(cfg.train.output_dir) / "export" / "sglang" / "config.json").read_text())
    assert sglang_captures(sglang["eagle_config"]["eagle_aux_hidden_state_layer_ids"]) == vllm_default(4)


def _fp8_variant(src: Path, out: Path, block: tuple[int, int]) -> Path:
    """src's linears stored as the fp8 releases store them (`weight` e4m3 + `weight_scale_inv` per block, float32
    scales; norms, router, embeddings, head and the indexer's head weights as they were) in out/fp8, and the weights
    they mean dequantized by the published rule in out/dequantized -> out."""
    tensors = load_file(src / "model.safetensors")
    config = json.loads((src / "config.json").read_text())
    stored, meant = {}, {}
    for name, t in tensors.items():
        if name.endswith(("proj.weight", ".wq_b.weight", ".wk.weight")) and not name.endswith("weights_proj.weight"):
            parts = tiny.fp8_blocks(t, block, torch.float32)
            rows = torch.arange(t.shape[0]) // block[0]
            cols = torch.arange(t.shape[1]) // block[1]
            meant[name] = parts["weight"].float() * parts["weight_scale_inv"][rows[:, None], cols[None, :]]
            stored.update({name: parts["weight"], name.removesuffix("weight") + "weight_scale_inv": parts["weight_scale_inv"]})
        else:
            stored[name] = meant[name] = t
    for kind, tensors, quant in (("fp8", stored, {**tiny.FP8_QUANT, "weight_block_size": list(block)}),
                                 ("dequantized", meant, None)):
        (out / kind).mkdir(parents=True)
        save_file(tensors, out / kind / "model.safetensors", metadata={"format": "pt"})
        (out / kind / "config.json").write_text(json.dumps({**config, **({"quantization_config": quant} if quant else {})}))
    return out


@pytest.mark.parametrize("name", ["glm4_moe_lite", "deepseek_v32", "glm_moe_dsa"])
def test_fp8_blocks_give_the_states_of_their_dequantized_weights(tmp_path, name):
    """Blocks of 16 x 24 over the tiny dims (every linear ends in a partial block; the indexer's wq_b and wk in fp8
    too): ours on the fp8 files equal transformers on the dequantized weights, whole and chunked past the top-k."""
    _transformers_target(tmp_path / "src", name)
    out = _fp8_variant(tmp_path / "src", tmp_path, (16, 24))
    model = transformers.AutoModelForCausalLM.from_pretrained(out / "dequantized", attn_implementation="eager",
                                                              dtype=torch.float32).eval()
    ids = torch.randint(0, 128, (48,), generator=torch.Generator().manual_seed(6))
    _, final = _reference(model, ids)
    assert inspect(str(out / "fp8"))["weights"]["quantized_linears"]["fp8"] > 0
    for chunk in (4096, 20):
        runner = TargetRunner(Checkpoint(out / "fp8"), [1, 2, 3], torch.device("cpu"), torch.float32, chunk_tokens=chunk)
        _close(runner.run(ids, [0, 48])["final_hidden"], final)


@pytest.mark.parametrize("model_type", ["deepseek_v3", "deepseek_v32", "glm4_moe_lite", "glm_moe_dsa"])
def test_router_fields_left_out_read_as_the_engines_config_class_defaults_them(tmp_path, model_type):
    """A config without n_group, topk_group, norm_topk_prob or routed_scaling_factor: the engines load it through
    the family's transformers config class, whose defaults differ by family; ours are the same."""
    from transformers import AutoConfig
    from eagle3.models.deepseek import ROUTER_FIELDS, DeepseekSpec
    from eagle3.models.weights import read_config
    raw = {k: v for k, v in {**TINY, **DSA, "n_routed_experts": 16}.items() if k not in ("n_group", "topk_group")}
    (tmp_path / "config.json").write_text(json.dumps({**raw, "model_type": model_type}))
    spec = DeepseekSpec.from_config(read_config(tmp_path / "config.json"))
    theirs = AutoConfig.for_model(model_type)
    assert {k: getattr(spec, k) for k, _ in ROUTER_FIELDS} == {k: getattr(theirs, k) for k, _ in ROUTER_FIELDS}
