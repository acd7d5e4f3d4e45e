"""What a new user meets (issue 51's rows, issue 49's honest truncation): one clear line for every wrong input, and
counts of the data that add up, checked against a hand count."""
import http.server
import json
import threading
import time

import numpy as np
import pytest

from conftest import make_config
from eagle3 import extraction, generate, training
from eagle3.config import ConfigError
from eagle3.data.chat import ChatEncoder
from eagle3.data.inputs import InputError, read_records
from eagle3.data.shards import DataError, read_manifest
from eagle3.engines import EngineError, Pool, Retry, Server
from eagle3.models import tiny
from eagle3.models.weights import Checkpoint, TargetError

pytest.importorskip("tiktoken")


@pytest.fixture(scope="module")
def kimi(tmp_path_factory):
    """Kimi-K2.5's tokenizer files and chat template over a byte vocabulary: a text of n ASCII characters is n tokens."""
    return tiny.write_kimi_chat(tmp_path_factory.mktemp("kimi"), 516)


def write_lines(path, lines):
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


def chat(user, reasoning, content):
    return {"messages": [{"role": "user", "content": user},
                         {"role": "assistant", "reasoning_content": reasoning, "content": content}]}


def prompt_tokens(kimi, line) -> int:
    """The tokens before the reply: the line rendered as a prompt (a count apart from the training encode)."""
    return len(ChatEncoder(kimi).encode_prompt(line))


def test_row1_a_missing_data_path_is_one_line_with_workers_or_not(tmp_path):
    for workers in (1, 2):
        with pytest.raises(InputError, match=rf"{tmp_path / 'none.jsonl'}: file not found \(data.path\)"):
            read_records(tmp_path / "none.jsonl", 256, 4096, workers=workers)


def test_row2_generate_with_a_missing_data_path_names_it(tmp_path, llama_target):
    cfg = make_config(tmp_path, llama_target, tmp_path / "none.jsonl",
                      **{"generate.output_path": str(tmp_path / "out.jsonl")})
    with pytest.raises(InputError, match=rf"{tmp_path / 'none.jsonl'}: file not found \(data.path\)"):
        generate.run(cfg)


def test_row3_a_train_data_dir_that_is_a_file_is_one_line(tmp_path, llama_target, token_data):
    cfg = make_config(tmp_path, llama_target, token_data, **{"train.data_dir": str(token_data)})
    with pytest.raises(DataError, match=rf"{token_data}: a file, not a directory of shards"):
        training.Trainer(cfg)


def test_row4_a_thought_that_never_closes_is_refused_never_trained_as_content(tmp_path, kimi, capsys):
    cut = {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "<think>I am thinking 4"}]}
    data = write_lines(tmp_path / "chat.jsonl", [chat("2+2?", "add", "4"), cut])
    with pytest.raises(InputError, match=r"chat.jsonl:2: message 2 of 2: the reply opens <think> and never closes it"):
        read_records(data, 516, 4096, target_dir=kimi)
    records, stats = read_records(data, 516, 4096, "skip", target_dir=kimi)
    assert [r.line for r in records] == [1] and stats.skipped_lines == [2] and stats.chat.replies == 1
    assert "skipped" in capsys.readouterr().err


def test_row5_a_line_whose_prompt_is_longer_than_max_seq_len_is_dropped_and_counted(tmp_path, kimi, capsys):
    """Hand count: byte tokens, so "think" is 5 reasoning tokens and "</think>ok<|im_end|>" 4 content tokens."""
    short, long = chat("hi", "think", "ok"), chat("x" * 300, "think", "ok")
    assert ChatEncoder(kimi).encode(short).trained == {"reasoning": 5, "content": 4, "tool_calls": 0}
    data = write_lines(tmp_path / "chat.jsonl", [short, short, long])
    records, stats = read_records(data, 516, 150, target_dir=kimi)
    assert [r.line for r in records] == [1, 2] and stats.sequences == 2 and stats.truncated == 0
    assert (stats.lines, stats.used, stats.skipped, dict(stats.dropped)) == (3, 2, 0, {"prompt": 1})
    assert (stats.chat.lines, stats.chat.replies, stats.chat.replies_trained, stats.chat.replies_cut) == (3, 3, 2, 0)
    assert stats.tokens("trained") == {"reasoning": 10, "content": 8, "tool_calls": 0, "pre_tokenized": 0}
    assert stats.tokens("lost") == {"reasoning": 5, "content": 4, "tool_calls": 0, "pre_tokenized": 0}
    size = prompt_tokens(kimi, long)
    assert size > 300 and stats.prompts == [size, size]
    assert stats.describe() == (f"3 lines: 2 used as 2 sequences (0 cut at data.max_seq_len 150), 0 skipped, 1 dropped "
                                f"with nothing to train; 1 because the prompt before their first reply is longer than "
                                f"data.max_seq_len ({size}-{size} tokens)")
    assert stats.chat.describe().startswith("3 chat lines, 3 replies: 2 trained (0 cut short by data.max_seq_len), "
                                            "1 lost to it; trained tokens: reasoning 10, content 8, tool calls 0; "
                                            "0 lines in 0 sequences")
    err = capsys.readouterr().err
    assert f"1 line dropped because the prompt before their first reply is longer than data.max_seq_len ({size}-{size} " \
           f"tokens) (first: {data}:3)" in err
    assert "split by their template" not in err


def test_row6_no_usable_sequences_says_why_with_the_prompts_against_the_limit(tmp_path, kimi):
    lines = [chat("a" * n, "think", "ok") for n in (40, 90, 60)]
    sizes = [prompt_tokens(kimi, line) for line in lines]
    data = write_lines(tmp_path / "chat.jsonl", lines)
    with pytest.raises(InputError) as e:
        read_records(data, 516, 30, target_dir=kimi)
    assert str(e.value) == (f"{data}: no usable sequences: 3 lines: 0 used as 0 sequences (0 cut at data.max_seq_len "
                            f"30), 0 skipped, 3 dropped with nothing to train; 3 because the prompt before their first "
                            f"reply is longer than data.max_seq_len ({min(sizes)}-{max(sizes)} tokens); raise "
                            f"data.max_seq_len above {min(sizes)}")


@pytest.fixture
def web_server(tmp_path):
    """A plain web server (Python's own): a 404 page for /v1/models, 501 for any POST."""
    handler = lambda *a: http.server.SimpleHTTPRequestHandler(*a, directory=str(tmp_path))   # noqa: E731
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    httpd.RequestHandlerClass.log_message = lambda *a: None
    threading.Thread(target=httpd.serve_forever, args=(0.02,), daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def test_row7_a_web_server_that_is_no_llm_server_is_one_line_and_no_outage(web_server):
    retry = Retry(attempts=2, wait_s=0.5, timeout_s=5)
    with pytest.raises(EngineError) as e:
        Pool([web_server], None, 1, retry)
    message = str(e.value)
    assert message.startswith(f"HTTP 404 from {web_server}/v1/models: a web page ('Error response'); expected the JSON "
                              "of an LLM server") and "\n" not in message and "<" not in message
    server, started = Server(web_server, retry), time.monotonic()
    with pytest.raises(EngineError, match=f"HTTP 501 from {web_server}/v1/completions: a web page"):
        server.call("/v1/completions", {"prompt": [1]})
    assert server.retries == 0 and time.monotonic() - started < 0.5   # an answer, not an outage: never retried


def test_row8_a_generate_output_path_that_is_a_directory_says_so(tmp_path, llama_target, token_data):
    (tmp_path / "out").mkdir()
    cfg = make_config(tmp_path, llama_target, token_data, **{"generate.output_path": str(tmp_path / "out")})
    with pytest.raises(generate.GenerateError, match=rf"{tmp_path / 'out'}: a directory; generate.output_path names"):
        generate.run(cfg)


def test_row9_tool_ids_missing_where_the_template_renders_them_are_counted_once(tmp_path, kimi, capsys):
    call = {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    line = {"messages": [{"role": "user", "content": "Weather?"},
                         {"role": "assistant", "reasoning_content": "call", "content": "", "tool_calls": [call]},
                         {"role": "tool", "content": "sunny"},
                         {"role": "assistant", "reasoning_content": "report", "content": "Sunny."}]}
    whole = json.loads(json.dumps(line))
    whole["messages"][1]["tool_calls"][0]["id"] = whole["messages"][2]["tool_call_id"] = "functions.get_weather:0"
    data = write_lines(tmp_path / "chat.jsonl", [line, whole, line])
    _, stats = read_records(data, 516, 4096, target_dir=kimi)
    assert dict(stats.chat.missing) == {"tool_calls[].id": 2, "tool_call_id": 2}
    err = capsys.readouterr().err
    for name in ("tool_calls[].id", "tool_call_id"):
        assert err.count(f"2 chat lines lack {name}, which the chat template renders (first: {data}:1)") == 1


def test_row10a_reasoning_on_a_user_turn_says_so(tmp_path, kimi):
    user = {"messages": [{"role": "user", "content": "hi", "reasoning_content": "no"},
                         {"role": "assistant", "content": "hello"}]}
    with pytest.raises(InputError, match="message 1 of 2: reasoning_content on a user turn; only assistant turns"):
        read_records(write_lines(tmp_path / "user.jsonl", [user]), 516, 4096, target_dir=kimi)


def test_row10b_a_target_path_naming_a_weights_file_says_it_is_a_file(llama_target):
    with pytest.raises(TargetError, match=r"model-00001-of-00002.safetensors: a file, not a directory; target.path"):
        Checkpoint(llama_target / "model-00001-of-00002.safetensors")
    assert Checkpoint(llama_target / "config.json").dir == llama_target   # its config.json still names it


def test_row10c_add_generation_prompt_in_the_config_is_a_config_error(tmp_path, llama_target, token_data):
    with pytest.raises(ConfigError, match=r"command line --data.chat_template_kwargs: data.chat_template_kwargs may "
                                          "not set add_generation_prompt"):
        make_config(tmp_path, llama_target, token_data, **{"data.chat_template_kwargs": '{"add_generation_prompt": true}'})


def test_row10d_a_line_whose_loss_mask_is_all_zero_is_counted_with_nothing_to_train(tmp_path, token_data, capsys):
    lines = [json.loads(x) for x in token_data.read_text().splitlines()[:3]]
    lines[1]["loss_mask"] = [0] * len(lines[1]["loss_mask"])
    records, stats = read_records(write_lines(tmp_path / "tokens.jsonl", lines), 256, 4096)
    assert [r.line for r in records] == [1, 3] and (stats.lines, stats.used, dict(stats.dropped)) == (3, 2, {"no_loss": 1})
    assert f"1 line dropped because their loss_mask is all 0 (first: {tmp_path / 'tokens.jsonl'}:2)" in capsys.readouterr().err


def test_issue49_extract_reports_the_trained_tokens_lost_to_max_seq_len_by_category(tmp_path, capsys):
    """Hand count: a chat reply of 40 reasoning and 4 content tokens cut 3 tokens into its reasoning; a pre-tokenized
    line of 5 + 15 loss tokens cut after its first 5; the manifest and the printout give both, and warn."""
    target = tiny.make_kimi(tmp_path / "target", layers=4, vocab=516, shards=1)
    tiny.write_kimi_chat(target, 516)
    line = chat("hi", "r" * 40, "ok")
    limit = prompt_tokens(target, line) + 3
    ids = list(range(1, limit + 11))
    tokens = {"input_ids": ids, "loss_mask": [0] * (limit - 5) + [1] * 15}
    data = write_lines(tmp_path / "mixed.jsonl", [line, tokens])
    extraction.run(make_config(tmp_path, target, data, **{"data.max_seq_len": limit}))
    source = read_manifest(tmp_path / "hidden")["source"]
    assert source["lost_tokens"] == {"reasoning": 37, "content": 4, "tool_calls": 0, "pre_tokenized": 10}
    assert source["trained_tokens"] == {"reasoning": 3, "content": 0, "tool_calls": 0, "pre_tokenized": 5}
    assert (source["truncated"], source["chat"]["replies_cut"], source["chat"]["replies_lost"]) == (2, 1, 0)
    out, err = capsys.readouterr()
    lost = f"data.max_seq_len {limit} cuts off 51 trained tokens (86.4%: reasoning 37, content 4, pre-tokenized 10)"
    assert f"extract: {lost}" in out   # 51 / (51 + 3 + 5)
    assert f"warning: {data}: {lost}, more than 5% of them: the draft does not learn the end of long replies; raise " \
           "data.max_seq_len" in err
    _, stats = read_records(data, 516, 4096, target_dir=target)   # nothing lost: no warning
    assert stats.describe_lost() is None and "cuts off" not in capsys.readouterr().err
