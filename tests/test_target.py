import copy
import json
import re
import subprocess
import sys

import pytest
import torch

from conftest import KIMI_FIXTURE, ROOT, make_llama
from eagle3.models.inspect import inspect
from eagle3.models import deepseek, tiny
from eagle3.models.weights import Checkpoint, TargetError, read_config
from eagle3.models.streaming import TargetRunner, greedy_argmax


def test_inspect_kimi_fixture_config_alone():
    out = subprocess.run([sys.executable, "-m", "eagle3", "inspect", str(KIMI_FIXTURE)], cwd=ROOT,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["model_type"] == "kimi_k25" and report["text_model_type"] == "kimi_k2"
    assert (report["hidden_size"], report["vocab_size"], report["num_hidden_layers"]) == (7168, 163840, 61)
    assert report["aux_layer_ids"] == [1, 29, 57]
    assert report["quantization"]["num_bits"] == 4 and report["quantization"]["group_size"] == 32
    assert report["weights"].startswith("missing") and report["lm_head"] is None
    assert report["rope_scaling"]["rope_type"] == "yarn"


def test_config_variants(tmp_path):
    raw = json.loads(KIMI_FIXTURE.read_text())
    text = raw["text_config"]
    # rope_parameters with rope_type and rope_theta inside; quantization and tie at the top level
    variant = copy.deepcopy(raw)
    t = variant["text_config"]
    t["rope_parameters"] = {**t.pop("rope_scaling"), "rope_theta": t.pop("rope_theta")}
    t["rope_parameters"]["rope_type"] = t["rope_parameters"].pop("type")
    variant["quantization_config"] = t.pop("quantization_config")
    t.pop("tie_word_embeddings")
    variant["tie_word_embeddings"] = True
    path = tmp_path / "config.json"
    path.write_text(json.dumps(variant))
    cfg = read_config(path)
    assert cfg.rope_theta == text["rope_theta"] and cfg.rope_scaling["rope_type"] == "yarn"
    assert cfg.rope_scaling["factor"] == 64 and cfg.quantization["num_bits"] == 4
    assert cfg.tie_word_embeddings
    # flat config (no wrapper)
    path.write_text(json.dumps(text))
    flat = read_config(path)
    assert flat.model_type == flat.text_model_type == "kimi_k2" and flat.hidden_size == 7168


def test_missing_field_names_file_and_field(tmp_path):
    raw = json.loads(KIMI_FIXTURE.read_text())
    del raw["text_config"]["vocab_size"]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(TargetError, match=r"config.json:text_config: missing field 'vocab_size'"):
        inspect(str(tmp_path))
    out = subprocess.run([sys.executable, "-m", "eagle3", "inspect", str(tmp_path)], cwd=ROOT,
                         capture_output=True, text=True)
    assert out.returncode != 0 and "missing field 'vocab_size'" in out.stderr
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(TargetError, match="not valid JSON"):
        inspect(str(tmp_path))


def test_inspect_tiny_checkpoint(llama_target):
    report = inspect(str(llama_target))
    assert report["weights"]["files"] == 2 and report["weights"]["prefix"] == "model."
    assert report["embed_tokens"] == {"name": "model.embed_tokens.weight", "shape": [256, 32], "dtype": "BF16"}
    assert report["lm_head"]["name"] == "lm_head.weight" and report["norm"]["shape"] == [32]
    assert report["aux_layer_ids"] == [1, 1, 1]


@pytest.mark.parametrize("reader", ["inspect", "runner"])   # the runner: before any compute
def test_inconsistent_shapes_are_reported(tmp_path, reader):
    path = make_llama(tmp_path, hidden=32, layers=4, heads=4, kv_heads=2, intermediate=64, vocab=64)
    cfg = json.loads((path / "config.json").read_text())
    cfg["vocab_size"] = 100
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(TargetError, match=r"model.embed_tokens.weight has shape \[64, 32\].*vocab_size 100"):
        if reader == "inspect":
            inspect(str(path))
        else:
            TargetRunner(Checkpoint(path), [1, 1, 2], torch.device("cpu"), torch.float32)


def test_tied_embeddings_and_only_requested_tensors(tmp_path):
    path = make_llama(tmp_path, hidden=32, layers=4, heads=4, kv_heads=2, intermediate=64, vocab=64,
                      tie=True)
    ckpt = Checkpoint(path)
    assert ckpt.head_name is None and ckpt.full_name("lm_head.weight") == "model.embed_tokens.weight"
    assert torch.equal(ckpt.get("lm_head.weight"), ckpt.get("embed_tokens.weight"))
    cfg = json.loads((path / "config.json").read_text())
    cfg["tie_word_embeddings"] = False
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(TargetError, match="no 'lm_head.weight' tensor and tie_word_embeddings is false"):
        Checkpoint(path)


def _dense_llama(ckpt: Checkpoint, ids: torch.Tensor, layers_out: list[int]):
    """Independent straightforward forward of one sequence (no packing, no streaming), fp32."""
    c = ckpt.config
    g = lambda n: ckpt.get(n).float()  # noqa: E731
    H, nh, nkv, hd = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim
    T = ids.numel()

    def norm(x, w, eps=c.rms_norm_eps):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    inv = 1.0 / (c.rope_theta ** (torch.arange(0, hd, 2).float() / hd))
    ang = torch.arange(T).float()[:, None] * inv[None]
    cos, sin = ang.cos(), ang.sin()

    def rope(x):  # rotate-half on [T, h, hd]
        x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
        return torch.cat([x1 * cos[:, None] - x2 * sin[:, None], x2 * cos[:, None] + x1 * sin[:, None]], -1)

    h = g("embed_tokens.weight")[ids]
    captured = []
    for i in range(c.num_hidden_layers):
        p = f"layers.{i}."
        x = norm(h, g(p + "input_layernorm.weight"))
        q = (x @ g(p + "self_attn.q_proj.weight").T).view(T, nh, hd)
        k = (x @ g(p + "self_attn.k_proj.weight").T).view(T, nkv, hd)
        v = (x @ g(p + "self_attn.v_proj.weight").T).view(T, nkv, hd)
        q, k = rope(q), rope(k)
        k, v = k.repeat_interleave(nh // nkv, 1), v.repeat_interleave(nh // nkv, 1)
        s = torch.einsum("thd,shd->hts", q, k) / hd ** 0.5
        s = s.masked_fill(torch.ones(T, T).triu(1).bool(), float("-inf")).softmax(-1)
        h = h + torch.einsum("hts,shd->thd", s, v).reshape(T, -1) @ g(p + "self_attn.o_proj.weight").T
        x = norm(h, g(p + "post_attention_layernorm.weight"))
        gate = torch.nn.functional.silu(x @ g(p + "mlp.gate_proj.weight").T)
        h = h + (gate * (x @ g(p + "mlp.up_proj.weight").T)) @ g(p + "mlp.down_proj.weight").T
        if i in layers_out:
            captured.append(h)
    final = norm(h, g("norm.weight"))
    return torch.cat(captured, -1), final, (final @ g("lm_head.weight").T).argmax(-1)


def test_llama_forward_matches_dense_reference(llama_target):
    ckpt = Checkpoint(llama_target)
    aux_ids = [1, 2, 3]
    runner = TargetRunner(ckpt, aux_ids, torch.device("cpu"), torch.float32, chunk_tokens=25)
    ids = torch.randint(0, 256, (60,))
    cu = [0, 17, 40, 60]
    out = runner.run(ids, cu)
    for a, b in zip(cu[:-1], cu[1:]):
        aux, final, argmax = _dense_llama(ckpt, ids[a:b], aux_ids)
        torch.testing.assert_close(out["aux_hidden"][a:b], aux, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(out["final_hidden"][a:b], final, rtol=1e-4, atol=1e-4)
        assert (out["target_argmax"][a:b] == argmax).float().mean() > 0.95


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_qwen_variants_run_and_chunking_is_exact(tmp_path, family):
    path = make_llama(tmp_path, family=family, hidden=32, layers=4, heads=4, kv_heads=2,
                      intermediate=64, vocab=64)
    ckpt = Checkpoint(path)
    names = set(ckpt.text_tensor_names())
    assert ("model.layers.0.self_attn.q_proj.bias" in names) == (family == "qwen2")
    assert ("model.layers.0.self_attn.q_norm.weight" in names) == (family == "qwen3")
    ids = torch.randint(0, 64, (30,))
    small = TargetRunner(ckpt, [1, 1, 2], torch.device("cpu"), torch.float32, chunk_tokens=5).run(ids, [0, 9, 20, 30])
    big = TargetRunner(ckpt, [1, 1, 2], torch.device("cpu"), torch.float32, chunk_tokens=1000).run(ids, [0, 9, 20, 30])
    for key in small:
        torch.testing.assert_close(small[key], big[key])


def test_greedy_argmax_in_vocab_chunks():
    final, head = torch.randn(37, 16), torch.randn(100, 16)
    assert torch.equal(greedy_argmax(final, head, rows=8, vocab_chunk=7).long(), (final @ head.T).argmax(-1))


def test_missing_layer_tensor_fails_before_any_compute(tmp_path):
    path = make_llama(tmp_path, hidden=32, layers=4, heads=4, kv_heads=2, intermediate=64, vocab=64, shards=2)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    del index["weight_map"]["model.layers.3.mlp.up_proj.weight"]
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(TargetError, match=r"1 of the \d+ tensors the forward reads are missing.*"
                                          r"model.layers.3.mlp.up_proj.weight"):
        TargetRunner(Checkpoint(path), [1, 1, 2], torch.device("cpu"), torch.float32)


def test_a_null_rope_theta_means_the_default():
    from eagle3.models.weights import rope_settings
    assert rope_settings({"rope_theta": None}) == (10000.0, None)
    assert rope_settings({"rope_parameters": {"rope_type": "default", "rope_theta": 5e5}}) == (5e5, None)


# ---------------------------------------------------------------------------------------------
# the family from model_type / architectures, its fields, and every tensor's shape (issue 35, row 4)

@pytest.fixture(scope="module")
def kimi_target(tmp_path_factory):
    return tiny.make_kimi(tmp_path_factory.mktemp("kimi"))


def _variant(target, tmp_path, edit_config=None, edit_tensors=None):
    """A copy of `target` in tmp_path (weight files linked) with its config.json and tensors edited:
    edit_config(raw dict), edit_tensors(file name, {name: tensor}) -> the file's new tensors or None."""
    from safetensors.torch import load_file, save_file
    tmp_path.mkdir(exist_ok=True)
    for f in target.iterdir():
        if f.name == "config.json" or (edit_tensors and f.suffix == ".safetensors"):
            continue
        (tmp_path / f.name).symlink_to(f)
    raw = json.loads((target / "config.json").read_text())
    if edit_config:
        edit_config(raw)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    for f in target.glob("*.safetensors") if edit_tensors else []:
        tensors = load_file(f)
        save_file(edit_tensors(f.name, tensors) or tensors, tmp_path / f.name)
    return tmp_path


def _cli_inspect(target):
    return subprocess.run([sys.executable, "-m", "eagle3", "inspect", str(target)], cwd=ROOT,
                          capture_output=True, text=True)


@pytest.mark.parametrize("field", ["kv_lora_rank", "n_routed_experts"])
def test_a_deepseek_config_missing_a_family_field_is_named(kimi_target, tmp_path, field):
    # before: no kv_lora_rank ran the Kimi target as a Llama; no n_routed_experts as dense layers
    target = _variant(kimi_target, tmp_path, lambda raw: raw["text_config"].pop(field))
    want = (rf"{tmp_path / 'config.json'}:text_config: missing field '{field}': model_type 'kimi_k2' "
            r"\(DeepSeek-V3 family\) needs it \(an integer\)")
    with pytest.raises(TargetError, match=want):
        inspect(str(target))
    with pytest.raises(TargetError, match=want):
        Checkpoint(target)   # what extract, train and evaluate open first
    out = _cli_inspect(target)
    assert out.returncode != 0 and out.stdout == ""
    assert out.stderr.strip().splitlines() == [f"error: {tmp_path / 'config.json'}:text_config: missing field "
                                               f"'{field}': model_type 'kimi_k2' (DeepSeek-V3 family) needs it "
                                               "(an integer)"]


def test_a_wrongly_typed_family_field_is_named(kimi_target, tmp_path):
    target = _variant(kimi_target, tmp_path, lambda raw: raw["text_config"].update(n_routed_experts="8"))
    with pytest.raises(TargetError, match=r"config.json:text_config: field 'n_routed_experts' = '8'; "
                                          r"model_type 'kimi_k2' \(DeepSeek-V3 family\) needs an integer"):
        inspect(str(target))


def test_the_family_comes_from_model_type_or_architectures(kimi_target, llama_target, tmp_path):
    assert inspect(str(kimi_target))["family"] == "DeepSeek-V3"
    assert inspect(str(llama_target))["family"] == "Llama"
    # no model_type at either level: the architectures decide
    no_type = _variant(kimi_target, tmp_path, lambda raw: [raw.pop("model_type"), raw["text_config"].pop("model_type")])
    needs = read_config(no_type / "config.json").needs
    assert needs == "architectures ['DeepseekV3ForCausalLM'] (DeepSeek-V3 family)"


def test_an_unknown_model_type_is_refused_listing_the_supported_ones(llama_target, tmp_path):
    # whatever fields it has (here Llama's): before, anything without kv_lora_rank ran as a Llama
    gpt = _variant(llama_target, tmp_path / "a", lambda raw: raw.update(model_type="gpt2"))
    out = _cli_inspect(gpt)
    assert out.returncode != 0 and out.stdout == "" and len(out.stderr.strip().splitlines()) == 1
    assert (f"{gpt / 'config.json'}: unsupported target (model_type 'gpt2'); supported model_types: deepseek_v3, "
            "kimi_k2, kimi_k25 (DeepSeek-V3 family); ") in out.stderr
    for named in ("glm4_moe_lite (GLM-4.7-Flash family)", "deepseek_v32 (DeepSeek-V3.2 family)",
                  "glm_moe_dsa (GLM-5 family)", "llama, mistral, qwen2, qwen3 (Llama family)"):
        assert named in out.stderr
    nothing = _variant(llama_target, tmp_path / "b", lambda raw: [raw.pop("model_type"), raw.pop("architectures")])
    with pytest.raises(TargetError, match=r"config.json: unsupported target \(no model_type or architectures\)"):
        Checkpoint(nothing)


def _replace(name, tensor):
    """edit_tensors for `_variant`: tensor `name` replaced by `tensor` in the file that holds it."""
    return lambda file, tensors: {**tensors, name: tensor} if name in tensors else None


def test_a_llama_tensor_of_the_wrong_shape_is_listed_by_inspect_and_before_compute(llama_target, tmp_path):
    name = "model.layers.2.self_attn.k_proj.weight"   # [kv_heads * head_dim, hidden] = [16, 32]
    target = _variant(llama_target, tmp_path, edit_tensors=_replace(name, torch.zeros(16, 24, dtype=torch.bfloat16)))
    out = _cli_inspect(target)
    assert out.returncode != 0 and out.stdout == "" and len(out.stderr.strip().splitlines()) == 1
    assert (f"{target / 'model.safetensors.index.json'}: 1 of the 45 tensors checked do not have the shape "
            f"{target / 'config.json'} implies: {name} is [16, 24], expected [16, 32]") in out.stderr
    with pytest.raises(TargetError, match=rf"{name} is \[16, 24\], expected \[16, 32\]"):
        TargetRunner(Checkpoint(target), [1, 1, 2], torch.device("cpu"), torch.float32)


def test_deepseek_tensors_of_the_wrong_shape_are_listed_by_inspect(kimi_target, tmp_path):
    p = "language_model.model.layers."
    packed = p + "3.mlp.experts.5.down_proj.weight_packed"   # int4 [hidden, moe_intermediate / 8] = [64, 4]
    scale = p + "2.mlp.experts.1.up_proj.weight_scale"      # [32, 64 / g]: 2 groups of 32
    dense = p + "1.self_attn.kv_b_proj.weight"              # [heads * (nope + v), kv_lora] = [128, 16]
    wrong = {packed: torch.zeros(64, 8, dtype=torch.int32), scale: torch.zeros(32, 3, dtype=torch.bfloat16),
             dense: torch.zeros(128, 15, dtype=torch.bfloat16)}
    target = _variant(kimi_target, tmp_path, edit_tensors=lambda file, tensors: {
        **tensors, **{n: t for n, t in wrong.items() if n in tensors}})
    with pytest.raises(TargetError) as e:
        inspect(str(target))
    message = str(e.value)
    assert message.startswith(f"{target / 'model.safetensors.index.json'}: 3 of the 356 tensors checked do not have "
                              f"the shape {target / 'config.json'}:text_config implies: ")
    assert f"{dense} is [128, 15], expected [128, 16]" in message
    assert f"{scale} is [32, 3], expected [32, 64/g] for a group size g that is a multiple of 8" in message
    assert f"{packed} is [64, 8], expected [64, 4]" in message
    # the loading code agrees: the same tensors refused when their layer is loaded
    model = deepseek.DeepseekTarget(Checkpoint(target), torch.device("cpu"), torch.float32)
    with pytest.raises(TargetError, match=re.escape(f"{packed} has shape [64, 8]; expected [64, 4]")):
        model.load_layer(3)
