"""Shared fixtures: tiny targets with real layouts, token data, and a config pointing at them."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
from concurrent.futures import Future
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from eagle3 import config as config_mod  # noqa: E402
from eagle3.models import tiny  # noqa: E402

KIMI_FIXTURE = ROOT / "tests" / "fixtures" / "kimi-k2.5" / "config.json"   # the real file, copied
LLAMA_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


def make_llama(out: str | Path, family: str = "llama", hidden: int = 64, layers: int = 6, heads: int = 4,
               kv_heads: int = 2, intermediate: int = 128, vocab: int = 512, tie: bool = False, shards: int = 1,
               seed: int = 0, dtype: torch.dtype = torch.bfloat16) -> Path:
    """A miniature Llama / Qwen2 / Qwen3 checkpoint (Qwen2's q/k/v biases, Qwen3's q/k norms)."""
    head_dim = hidden // heads
    config = {"architectures": [LLAMA_ARCHITECTURES[family]], "model_type": family, "hidden_size": hidden,
              "intermediate_size": intermediate, "num_hidden_layers": layers, "num_attention_heads": heads,
              "num_key_value_heads": kv_heads, "head_dim": head_dim, "vocab_size": vocab, "rms_norm_eps": 1e-6,
              "rope_theta": 10000.0, "max_position_embeddings": 4096, "tie_word_embeddings": tie,
              "torch_dtype": "bfloat16", "hidden_act": "silu", "bos_token_id": 1, "eos_token_id": 2}
    out, t, rand, ones, mlp, _ = tiny.start_target(out, config, seed, dtype)
    t.update({"model.embed_tokens.weight": rand(vocab, hidden, std=1.0), "model.norm.weight": ones(hidden)})
    if not tie:
        t["lm_head.weight"] = rand(vocab, hidden, std=3 * hidden ** -0.5)
    for i in range(layers):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = ones(hidden)
        t[p + "post_attention_layernorm.weight"] = ones(hidden)
        t[p + "self_attn.q_proj.weight"] = rand(heads * head_dim, hidden)
        t[p + "self_attn.k_proj.weight"] = rand(kv_heads * head_dim, hidden)
        t[p + "self_attn.v_proj.weight"] = rand(kv_heads * head_dim, hidden)
        t[p + "self_attn.o_proj.weight"] = rand(hidden, heads * head_dim, std=0.3 * hidden ** -0.5)   # small: see mlp
        mlp(p + "mlp.", hidden, intermediate)
        if family == "qwen2":
            for n, width in (("q_proj", heads), ("k_proj", kv_heads), ("v_proj", kv_heads)):
                t[p + f"self_attn.{n}.bias"] = rand(width * head_dim, std=0.02)
        if family == "qwen3":
            t.update({p + "self_attn.q_norm.weight": ones(head_dim), p + "self_attn.k_norm.weight": ones(head_dim)})
    tiny.save_sharded(t, out, shards)
    return out


@pytest.fixture(scope="session")
def llama_target(tmp_path_factory) -> Path:
    return make_llama(tmp_path_factory.mktemp("llama"), hidden=32, layers=5, heads=4, kv_heads=2,
                      intermediate=64, vocab=256, shards=2)


@pytest.fixture(scope="session")
def token_data(tmp_path_factory) -> Path:
    return tiny.make_token_data(tmp_path_factory.mktemp("data") / "data.jsonl", vocab=256, sequences=48,
                                min_len=8, max_len=40)


@pytest.fixture(scope="module")
def hidden(tmp_path_factory, llama_target, token_data) -> Path:
    """Shards of the tiny Llama target over the token data; one copy per test module (some damage theirs)."""
    from eagle3 import extraction
    tmp = tmp_path_factory.mktemp("hidden")
    extraction.run(make_config(tmp, llama_target, token_data))
    return tmp / "hidden"


def edited_copy(src: Path, dst: Path, config=None, tensors=None) -> Path:
    """A copy of the checkpoint directory `src` (one model.safetensors) at `dst`, its config.json edited in place
    by `config(dict)` and its tensors by `tensors(dict)`."""
    shutil.copytree(src, dst)
    if config:
        data = json.loads((dst / "config.json").read_text())
        config(data)
        (dst / "config.json").write_text(json.dumps(data))
    if tensors:
        from safetensors.torch import load_file, save_file
        weights = load_file(dst / "model.safetensors")
        tensors(weights)
        save_file(weights, dst / "model.safetensors")
    return dst


def make_config(tmp_path: Path, target: Path, data: Path, **overrides) -> config_mod.Config:
    """A fast CPU config for tests; overrides as {"train.max_steps": 4}."""
    base = {
        "target.path": str(target), "data.path": str(data),
        "extract.output_dir": str(tmp_path / "hidden"), "debug.shard_tokens": 400,
        "debug.chunk_tokens": 300, "vocab.draft_vocab_size": 128,
        "train.output_dir": str(tmp_path / "train"), "train.max_steps": 6, "train.batch_tokens": 160,
        "train.ttt_steps": 3, "train.lr": 3e-3, "train.warmup_steps": 2, "train.eval_every": 3,
        "debug.log_every": 2, "train.checkpoint_every": 3, "debug.prefetch": 1, "debug.train_device": "cpu",
        "debug.extract_device": "cpu", "extract.dtype": "float32",
    }
    base.update(overrides)
    args = []
    for key, value in base.items():
        args += [f"--{key}", str(value)]
    return config_mod.load(None, args)


def _interpreted_child(script: str, *args: str, nice: bool = False) -> subprocess.CompletedProcess:
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    prefix = ["nice", "-n", "19"] if nice and shutil.which("nice") else []
    # at the lowest priority a child may wait for a busy CPU: more time before it counts as hung
    return subprocess.run([*prefix, sys.executable, script, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=1800 if prefix else 600)


class _Background:
    """The interpreted children of the collected modules that set `INTERPRETED_CHILD = True`, run one at a time on a
    thread at the lowest priority from collection on: they take the CPU the other tests leave idle (about a third
    of CI's 2 cores) instead of a minute of the run."""

    def __init__(self, scripts: list[str]):
        self.runs = {script: Future() for script in scripts}
        threading.Thread(target=self._run, args=(list(self.runs.items()),), daemon=True).start()

    @staticmethod
    def _run(runs: list[tuple[str, Future]]):
        for script, run in runs:
            try:
                run.set_result(_interpreted_child(script, nice=True))
            except BaseException as e:   # raised in the test that takes it
                run.set_exception(e)

    def take(self, script: str) -> subprocess.CompletedProcess | None:
        run = self.runs.pop(script, None)
        return run and run.result()


_background: _Background | None = None


def pytest_collection_modifyitems(config, items):
    global _background
    modules = (getattr(item, "module", None) for item in items)
    _background = _Background(list(dict.fromkeys(m.__file__ for m in modules if getattr(m, "INTERPRETED_CHILD", False))))


def run_interpreted(script: str, *args: str) -> tuple[dict, subprocess.CompletedProcess]:
    """Run a kernel test file as a script (with `args`) in a child process under TRITON_INTERPRET=1 (the variable
    must be set before triton is imported), or take its run begun at collection: ({case: record} of the JSON lines
    it printed, the process)."""
    proc = (not args and _background and _background.take(script)) or _interpreted_child(script, *args)
    records = map(json.loads, (line for line in proc.stdout.splitlines() if line.startswith("{")))
    return {rec["case"]: rec for rec in records}, proc


def assert_interpreted_case(results: tuple[dict, subprocess.CompletedProcess], case: int, label) -> None:
    """The child ran interpreted (its "interpreted" record) and case `case` reported ok."""
    out, proc = results
    assert out.get("interpreted", {}).get("ok"), f"the child did not run interpreted:\n{proc.stderr[-3000:]}"
    rec = out.get(str(case))
    assert rec is not None, f"case {label} did not report (rc {proc.returncode}):\n{proc.stderr[-3000:]}"
    assert rec["ok"], f"{label}: {rec['detail']}"


def raises_value_error(calls: dict) -> dict:
    """{name: whether calling it raised ValueError} of {name: call}: a kernel's refusals, reported by a child."""
    raised = {}
    for key, call in calls.items():
        try:
            call()
            raised[key] = False
        except ValueError:
            raised[key] = True
    return raised


def print_cases(names: list[str], run) -> None:
    """An interpreted child's output: one JSON line per case, `run(name)`'s record or the exception's trace."""
    import traceback
    for name in names:
        try:
            res = run(name)
        except Exception:
            res = {"exception": traceback.format_exc()[-3000:]}
        print(json.dumps({"case": name, **res}), flush=True)
