"""What vLLM 0.34.0 and SGLang 0.5.23 make of our exports, by their rules transcribed from their released sources
(`pip download --no-deps vllm==0.34.0 sglang==0.5.23`): which target layers each feeds the draft, which settings and
tensors each reads, and how each is served."""
from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch

from eagle3.config import ENGINES, ONE_LAYER, UNREAD, Config, ConfigError, load
from eagle3.draft import DraftSpec, Eagle3Draft
from eagle3.export import (ExportError, export_weights, mla_config, serving_commands, sglang_config, sglang_name,
                           vllm_config, vllm_name)

ROOT = Path(__file__).resolve().parents[1]


# --- the engines' rules ----------------------------------------------------------------------------

def vllm_fed(config: dict, layers: int) -> list[int]:
    """The target layers (0-based outputs) vLLM 0.34.0 hands the draft. v1/worker/gpu/spec_decode/eagle/
    eagle3_utils.py get_eagle3_aux_layers_from_config: the config's top-level eagle_aux_hidden_state_layer_ids (the
    speculators layout's is copied there by transformers_utils/configs/speculators/algos.py update_eagle3), else
    eagle_config["layer_ids"], else the model's default (2, L//2, L-3). model_executor/models/interfaces.py
    EagleModelMixin._set_aux_hidden_state_layers keeps sorted(set(ids)); _maybe_add_hidden_state captures
    hidden_states + residual entering layer v (llama.py; deepseek_v2.py DeepseekV2Model.forward the same, and v = L
    after the last layer): the output of layer v - 1."""
    ids = (config.get("eagle_aux_hidden_state_layer_ids") or (config.get("eagle_config") or {}).get("layer_ids")
           or [2, layers // 2, layers - 3])
    return [v - 1 for v in sorted(set(ids)) if 1 <= v <= layers]


def sglang_fed(config: dict, target: str, layers: int) -> list[int]:
    """The target layers SGLang 0.5.23 hands the draft. srt/model_executor/model_runner_components/
    spec_aux_hidden_state.py _resolve_eagle_aux_hidden_state reads eagle_config["eagle_aux_hidden_state_layer_ids"]
    alone. set_eagle3_layers_to_capture: srt/models/llama.py (qwen2.py, qwen3.py, qwen3_moe.py, minimax_m2.py,
    glm4_moe.py alike) [v + 1 for v in ids]; gpt_oss.py the same unless max(ids) == L, then the ids as they are;
    srt/models/deepseek_v2.py (kimi_k25.py delegates to it, DeepseekV32ForCausalLM and glm4_moe.py's
    GlmMoeDsaForCausalLM inherit it; glm4_moe_lite.py alike) the same only `if layer_ids and layer_ids[0] == 1`, else
    the ids as they are. The models' forward captures the input of layer i (the output of i - 1) for i in
    range(L) that is in layers_to_capture, in layer order."""
    ids = config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    as_given = ids[0] != 1 if target in MLA_TARGETS else target == "gpt-oss" and max(ids) == layers
    capture = list(ids) if as_given else [v + 1 for v in ids]
    return [i - 1 for i in range(layers) if i in capture]


def vllm_takes_verifier(name: object) -> bool:
    """vLLM 0.34.0 transformers_utils/config.py maybe_override_with_speculators (`vllm serve DRAFT_FOLDER`): the
    verifier must be a string that huggingface_hub's validate_repo_id accepts and no local path."""
    repo = re.fullmatch(r"(\b[\w\-.]+\b/)?\b[\w\-.]{1,96}\b", name) if isinstance(name, str) else None
    return bool(repo) and "--" not in name and ".." not in name and not Path(name).exists()


# --- the export against them -----------------------------------------------------------------------

def spec(attention: str = "gqa", layers: int = 1, **flags) -> DraftSpec:
    mla = dict(attention="mla", q_lora_rank=12, kv_lora_rank=8, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
               head_dim=24, num_key_value_heads=4) if attention == "mla" else {}
    return DraftSpec(**{**dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                intermediate_size=64, target_vocab_size=256, draft_vocab_size=128,
                                target_hidden_size=32, num_layers=layers, rms_norm_eps=1e-6, rope_theta=10000.0,
                                max_position_embeddings=512), **mla, **flags})


TARGETS = {"Llama-3": {"model_type": "llama", "text_model_type": "llama", "num_hidden_layers": 32},
           "Qwen3": {"model_type": "qwen3", "text_model_type": "qwen3", "num_hidden_layers": 36},
           "DeepSeek-V3": {"model_type": "deepseek_v3", "text_model_type": "deepseek_v3", "num_hidden_layers": 61},
           "Kimi-K2.5": {"model_type": "kimi_k25", "text_model_type": "kimi_k2", "num_hidden_layers": 61},
           "Qwen3-MoE": {"model_type": "qwen3_moe", "text_model_type": "qwen3_moe", "num_hidden_layers": 48},
           "MiniMax-M2": {"model_type": "minimax_m2", "text_model_type": "minimax_m2", "num_hidden_layers": 62},
           "GLM-4.5": {"model_type": "glm4_moe", "text_model_type": "glm4_moe", "num_hidden_layers": 92},
           "gpt-oss": {"model_type": "gpt_oss", "text_model_type": "gpt_oss", "num_hidden_layers": 24},
           "GLM-4.7-Flash": {"model_type": "glm4_moe_lite", "text_model_type": "glm4_moe_lite",
                             "num_hidden_layers": 47},
           "DeepSeek-V3.2": {"model_type": "deepseek_v32", "text_model_type": "deepseek_v32", "num_hidden_layers": 61},
           "GLM-5": {"model_type": "glm_moe_dsa", "text_model_type": "glm_moe_dsa", "num_hidden_layers": 78}}
# SGLang 0.5.23's rule of the first id (deepseek_v2.py, GLM-5's class inheriting it, glm4_moe_lite.py)
MLA_TARGETS = ("DeepSeek-V3", "Kimi-K2.5", "GLM-4.7-Flash", "DeepSeek-V3.2", "GLM-5")


def state(target: str, ids: list[int], draft: DraftSpec) -> dict:
    return {"resolved": {"draft_spec": dataclasses.asdict(draft), "aux_layer_ids": ids, "verifier_name": "org/target"},
            "target": TARGETS[target], "target_architectures": ["X"]}


def default_ids(target: str) -> list[int]:   # eagle3.models.weights.TextConfig.default_aux_layer_ids
    n = TARGETS[target]["num_hidden_layers"]
    return [1, n // 2 - 1, n - 4]


CASES = [(t, default_ids(t)) for t in TARGETS] + [(t, ids) for t in TARGETS for ids in ([2, 4, 5], [3, 17, 20])] + \
        [("Llama-3", [0, 3, 5])]


@pytest.mark.parametrize("attention", ["gqa", "mla"])
@pytest.mark.parametrize("target,ids", CASES)
def test_each_engine_feeds_the_draft_the_layers_it_trained_on(target, ids, attention):
    s, layers = state(target, ids, spec(attention)), TARGETS[target]["num_hidden_layers"]
    vllm = mla_config(s, Config()) if attention == "mla" else vllm_config(s, Config())
    sglang = mla_config(s, Config()) if attention == "mla" else sglang_config(s, Config())
    assert vllm_fed(vllm, layers) == ids
    assert sglang_fed(sglang, target, layers) == ids


@pytest.mark.parametrize("target,ids,why", [
    ("Kimi-K2.5", [0, 4, 5], "adds 1 to an MLA-family target's ids only when the first is 1"),
    ("DeepSeek-V3", [0, 30, 57], "only when the first is 1"),
    ("GLM-5", [0, 38, 74], "only when the first is 1"),
    ("GLM-4.7-Flash", [0, 22, 43], "only when the first is 1"),
    ("Llama-3", [1, 15, 31], "never the last layer's output"),
    ("Kimi-K2.5", [1, 29, 60], "never the last layer's output")])
def test_ids_sglang_cannot_express_are_refused_and_vllm_still_exports(target, ids, why):
    s, layers = state(target, ids, spec()), TARGETS[target]["num_hidden_layers"]
    with pytest.raises(ExportError, match=why):
        sglang_config(s, Config())
    assert vllm_fed(vllm_config(s, Config()), layers) == ids
    mla = state(target, ids, spec("mla"))
    assert vllm_fed(config := mla_config(mla, Config()), layers) == ids and "eagle_config" not in config


def test_a_run_refuses_such_ids_before_training(tmp_path, llama_target, token_data):
    """The tiny Llama target has 5 layers: SGLang cannot feed the draft layer 4's output."""
    from tests.conftest import make_config
    from eagle3 import training
    cfg = make_config(tmp_path, llama_target, token_data, **{"target.aux_layer_ids": "[1, 2, 4]"})
    with pytest.raises(ExportError, match="never the last layer's output"):
        training.run(cfg)
    assert not (tmp_path / "train" / "checkpoints").exists()   # refused before the first step


def test_ids_out_of_layer_order_are_refused():
    """Both engines feed the captured layers in layer order (vLLM sorts them; SGLang appends in its layer loop)."""
    with pytest.raises(ConfigError, match=r"aux_layer_ids = \[5, 2, 4\]; expected them in increasing order"):
        load(None, ["--target.aux_layer_ids", "[5, 2, 4]"])


# --- what each engine version reads ------------------------------------------------------------------

# transcribed from the draft classes: vLLM 0.34.0 model_executor/models/llama_eagle3.py (+ llama.py's layer_types /
# sliding_window) and deepseek_eagle3.py; SGLang 0.5.23 srt/models/llama_eagle3.py (+ --speculative-draft-window-size,
# srt/arg_groups/fields/spec.py) and kimi_k25_eagle3.py
READS = {("vllm", "gqa"): {"norm_before_residual", "norm_before_fc", "fc_norm", "norm_output", "sliding_window"},
         ("vllm", "mla"): {"norm_before_residual", "fc_norm", "norm_output"},
         ("sglang", "gqa"): {"norm_before_fc", "fc_norm", "norm_output", "sliding_window"},
         ("sglang", "mla"): {"fc_norm", "norm_output"}}
FLAGS = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output", "sliding_window")


def test_the_refusal_table_is_what_each_engine_version_does_not_read():
    for (fmt, kind), read in READS.items():
        # a window on an MLA draft is refused when it resolves (neither MLA class has one)
        assert set(UNREAD[fmt, kind]) == set(FLAGS) - read - ({"sliding_window"} if kind == "mla" else set())
    assert ONE_LAYER == {("sglang", "mla")}   # kimi_k25_eagle3.py: num_hidden_layers != 1 raises


def test_docs_table_of_what_each_engine_reads_is_the_codes():
    text = (ROOT / "docs" / "export.md").read_text()
    columns = [("vllm", "gqa"), ("vllm", "mla"), ("sglang", "gqa"), ("sglang", "mla")]
    header = f"| setting | {ENGINES['vllm']} Llama | {ENGINES['vllm']} MLA | {ENGINES['sglang']} Llama | " \
             f"{ENGINES['sglang']} MLA |"
    assert header in text, header
    rows = {line.split("|")[1].strip(" `"): [c.strip() for c in line.split("|")[2:6]]
            for line in text[text.index(header):].split("\n")[2:] if line.startswith("|")}
    for flag in FLAGS:
        for column, (fmt, kind) in enumerate(columns):
            read = flag in READS[fmt, kind]
            assert rows[flag][column].startswith("read" if read else "refused"), (flag, fmt, kind, rows[flag])


def sglang_llama_params(layers: int, flags: dict) -> set[str]:
    """The parameters SGLang 0.5.23's LlamaForCausalLMEagle3 computes with (srt/models/llama_eagle3.py): q/k/v and
    gate/up stacked at load; layer 0 normalises with input_layernorm and hidden_norm, a later one with hidden_norm
    alone (its input_layernorm is never used)."""
    out = {"model.fc.weight", "model.norm.weight", "lm_head.weight"}
    out |= {"model.input_norm.weight"} if flags.get("norm_before_fc") else set()
    out |= {f"model.fc_norm.{i}.weight" for i in range(3)} if flags.get("fc_norm") else set()
    for i in range(layers):
        p = f"model.layers.{i}."
        out |= {p + n for n in ("self_attn.qkv_proj.weight", "self_attn.o_proj.weight", "mlp.gate_up_proj.weight",
                                "mlp.down_proj.weight", "hidden_norm.weight", "post_attention_layernorm.weight")}
        out |= {p + "input_layernorm.weight"} if i == 0 else set()
    return out


def sglang_llama_loads(name: str) -> str | None:
    """LlamaForCausalLMEagle3.load_weights: the legacy map (midlayer -> layers.0), d2t / t2d taken aside, stacked
    shards renamed, `model.` prepended to a name it does not have."""
    for legacy, new in {"midlayer": "layers.0", "aux_norm_low": "fc_norm.0"}.items():
        name = name.replace(legacy, new)
    if name in ("d2t", "t2d"):
        return None
    for shard, param in ((".q_proj", ".qkv_proj"), (".k_proj", ".qkv_proj"), (".v_proj", ".qkv_proj"),
                         (".gate_proj", ".gate_up_proj"), (".up_proj", ".gate_up_proj")):
        name = name.replace(shard, param)
    return name if name == "lm_head.weight" else f"model.{name}"


@pytest.mark.parametrize("flags", [{}, {"norm_before_fc": True, "norm_output": True}, {"fc_norm": True}])
def test_sglang_loads_every_tensor_of_a_two_layer_draft_with_norms(flags):
    s = spec(layers=2, **flags)
    tensors = export_weights(dict(Eagle3Draft(s).state_dict()), dataclasses.asdict(s), sglang_name, 2, torch.float32)
    loaded = {n for n in map(sglang_llama_loads, tensors) if n is not None}
    assert loaded == sglang_llama_params(2, flags)
    config = sglang_config(state("Llama-3", [1, 15, 28], s), Config())
    assert config["num_hidden_layers"] == 2
    assert all(config[key] == flags.get(key, False) for key in ("norm_before_fc", "fc_norm", "norm_output"))
    assert set(export_weights(dict(Eagle3Draft(s).state_dict()), dataclasses.asdict(s), vllm_name, 2, torch.float32)) \
        == set(Eagle3Draft(s).state_dict())   # vLLM's names are ours


# --- serving --------------------------------------------------------------------------------------

def test_sglang_serves_a_windowed_draft_with_the_window_flag():
    """--speculative-draft-window-size S keeps S keys before the query and the query's own (SGLang 0.5.23: the
    flag becomes the draft layers' sliding_window_size in srt/models/llama_eagle3.py; FlashInfer's window_left = S,
    the Triton extend kernel keeps q <= kv + S), so a draft trained on W positions is served with S = W - 1."""
    cfg = load(None, ["--draft.sliding_window", "64"])   # refused for SGLang until it read the window
    s = state("Llama-3", [1, 15, 28], spec(sliding_window=64))
    lines = serving_commands(s, cfg, {"vllm": Path("out/vllm"), "sglang": Path("out/sglang")})
    assert "--speculative-draft-window-size 63" in lines[1] and "sglang.launch_server --model-path org/target" in lines[1]
    assert "--speculative-num-steps 3 --speculative-eagle-topk 1 --speculative-num-draft-tokens 4" in lines[1]
    assert lines[0].startswith("serve with vLLM 0.34.0: vllm serve org/target --speculative-config")
    assert json.loads(lines[0].split("'")[1]) == {"method": "eagle3", "model": "out/vllm", "num_speculative_tokens": 3}


def test_vllm_serve_of_the_draft_folder_gets_a_verifier_it_takes(tmp_path):
    """A target inside the Hugging Face cache is named by its repo id, which `vllm serve export/vllm` takes; a local
    target's path it refuses, and the printed command serves the target with --speculative-config instead."""
    from eagle3.resolve import hub_repo_id
    snapshot = tmp_path / "hub" / "models--moonshotai--Kimi-K2.5" / "snapshots" / "4f1c"
    snapshot.mkdir(parents=True)
    assert hub_repo_id(str(snapshot)) == "moonshotai/Kimi-K2.5" and vllm_takes_verifier("moonshotai/Kimi-K2.5")
    assert hub_repo_id(str(tmp_path)) is None and not vllm_takes_verifier(str(tmp_path))


def test_kimi_serving_commands_in_the_docs_extract_tool_calls():
    """vLLM 0.34.0 extracts tool calls for tool_choice "auto" only with --enable-auto-tool-choice
    (entrypoints/openai/chat_completion/message_assembly.py), which needs --tool-call-parser (cli_args.py)."""
    text = (ROOT / "docs" / "export.md").read_text()
    commands = re.findall(r"vllm serve .*?(?=\n\n|```)", text, re.S)
    assert commands and all("--enable-auto-tool-choice" in c for c in commands if "--tool-call-parser" in c)
    assert "--speculative-draft-window-size" in text
