"""The engine client (eagle3/engines.py) and `generate` through servers, against fake servers in this process that
answer with the shapes vLLM's /v1/completions and SGLang's /generate document (docs/generate.md): the request
fields, the reply ids and stop tokens, retries, dropped servers, one-line errors, resume. The real engine
(llama-cpp-python's server) is in tests/test_real_model.py."""
from __future__ import annotations

import http.server
import json
import socket
import threading

import pytest
import torch

from conftest import ROOT, make_config
from eagle3 import generate
from eagle3.engines import Decoding, EngineError, Pool, Retry, Server, TextCodec
from eagle3.models.incremental import IncrementalTarget
from eagle3.models.weights import Checkpoint
from eagle3.speculative import greedy_decode_many

FAST = Retry(attempts=2, wait_s=0.01, timeout_s=10)


class Fake:
    """An HTTP server on 127.0.0.1 answering `answer(path, body)`: (status, a JSON value or raw bytes)."""

    def __init__(self, answer, owned_by="vllm", models=("target",), max_model_len=4096):
        self.answer, self.requests, self.lock = answer, [], threading.Lock()
        self.models = {"object": "list", "data": [{"id": m, "object": "model", "created": 0, "owned_by": owned_by,
                                                   "root": m, "parent": None, "max_model_len": max_model_len}
                                                  for m in models]}
        fake = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                self.reply(*((200, fake.models) if self.path == "/v1/models" else (404, {"detail": "Not Found"})))

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with fake.lock:
                    fake.requests.append((self.path, body))
                self.reply(*fake.answer(self.path, body))

            def reply(self, status, payload):
                raw = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            def log_message(self, *args):
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, args=(0.02,), daemon=True).start()   # quick to shut down

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def fakes():
    made = []
    yield lambda *args, **kwargs: made.append(Fake(*args, **kwargs)) or made[-1]
    for fake in made:
        fake.close()


def refusing_url() -> str:
    """A port nothing listens on: connections are refused."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def vllm_answer(ids, finish="stop", stop_reason=None, **choice):
    """vLLM >= 0.10.2's /v1/completions answer with return_token_ids (CompletionResponse)."""
    return {"id": "cmpl-0", "object": "text_completion", "created": 0, "model": "target",
            "choices": [{"index": 0, "text": "", "logprobs": None, "finish_reason": finish, "stop_reason": stop_reason,
                         "token_ids": ids, "prompt_logprobs": None, "prompt_token_ids": None, **choice}],
            "usage": {"prompt_tokens": 3, "total_tokens": 3 + len(ids), "completion_tokens": len(ids)}}


def sglang_answer(ids, reason):
    """SGLang's native /generate answer for one input_ids list."""
    return {"text": "", "output_ids": ids, "meta_info": {"id": "0", "finish_reason": reason, "prompt_tokens": 3,
                                                         "completion_tokens": len(ids), "cached_tokens": 0}}


GREEDY = Decoding(max_new_tokens=8, temperature=0.0, top_p=1.0, stop=(2, 7))
SAMPLED = Decoding(max_new_tokens=8, temperature=1.0, top_p=0.95, stop=(2, 7))


def connected(url, model=None) -> Server:
    server = Server(url, FAST)
    server.connect(model)
    return server


def test_vllm_token_ids_in_and_out(fakes):
    fake = fakes(lambda path, body: (200, vllm_answer([11, 12, 7])))
    server = connected(fake.url + "/v1/")     # an OpenAI client's base URL works too
    assert (server.kind, server.model, server.context) == ("vllm", "target", 4096)
    reply = server.complete([1, 2, 3], SAMPLED, 42, None)
    assert (reply.ids, reply.cut, reply.retokenized) == ([11, 12, 7], False, False)
    path, body = fake.requests[-1]
    assert path == "/v1/completions"
    assert body == {"model": "target", "prompt": [1, 2, 3], "max_tokens": 8, "temperature": 1.0, "top_p": 0.95,
                    "seed": 42, "presence_penalty": 0.0, "frequency_penalty": 0.0, "top_k": -1, "min_p": 0.0,
                    "repetition_penalty": 1.0, "stop_token_ids": [2, 7], "skip_special_tokens": False,
                    "return_token_ids": True}
    server.complete([1, 2, 3], GREEDY, 42, None)
    assert "seed" not in fake.requests[-1][1] and fake.requests[-1][1]["temperature"] == 0.0
    fake.answer = lambda path, body: (200, vllm_answer([11, 12, 13], "length"))
    assert server.complete([1, 2, 3], GREEDY, 0, None).cut
    # the server's context caps the reply; a prompt that fills it is refused naming the server
    server.context = 5
    server.complete([1, 2, 3], GREEDY, 0, None)
    assert fake.requests[-1][1]["max_tokens"] == 2
    with pytest.raises(EngineError, match=f"{fake.url}: a prompt of 5 tokens leaves no room .* max_model_len 5"):
        server.complete([1, 2, 3, 4, 5], GREEDY, 0, None)


def test_sglang_native_generate(fakes):
    answers = iter([sglang_answer([21, 22, 2], {"type": "stop", "matched": 2}),
                    sglang_answer([21, 22], {"type": "stop", "matched": 2}),       # a version that trims the stop
                    sglang_answer([21, 22, 23], {"type": "length", "length": 3})])
    fake = fakes(lambda path, body: (200, next(answers)), owned_by="sglang")
    server = connected(fake.url)
    assert server.kind == "sglang"
    assert server.complete([1, 2], SAMPLED, 9, None).ids == [21, 22, 2]
    path, body = fake.requests[-1]
    assert path == "/generate" and body["input_ids"] == [1, 2]
    assert body["sampling_params"] == {"max_new_tokens": 8, "temperature": 1.0, "top_p": 0.95, "presence_penalty": 0.0,
                                       "frequency_penalty": 0.0, "sampling_seed": 9, "top_k": -1, "min_p": 0.0,
                                       "repetition_penalty": 1.0, "stop_token_ids": [2, 7], "skip_special_tokens": False,
                                       "no_stop_trim": True}
    assert server.complete([1, 2], GREEDY, 9, None).ids == [21, 22, 2]
    assert "sampling_seed" not in fake.requests[-1][1]["sampling_params"]
    reply = server.complete([1, 2], GREEDY, 9, None)
    assert (reply.ids, reply.cut) == ([21, 22, 23], True)


def test_text_only_server_is_sent_text_and_its_replies_retokenized(fakes):
    """A server that is neither vLLM nor SGLang (llama-cpp-python's owned_by is "me"): text in and out."""
    vocab = {"<s>": 1, "</s>": 2, "a": 10, "b": 11, "ab": 12}
    names = {i: t for t, i in vocab.items()}
    codec = TextCodec(lambda text: [vocab["ab"]] * (text.count("ab")) + [vocab[c] for c in text.replace("ab", "")],
                      lambda ids: "".join(names[i] for i in ids))
    answers = iter([{"choices": [{"text": "ab", "finish_reason": "stop"}], "usage": {"completion_tokens": 1}},
                    {"choices": [{"text": "ab", "finish_reason": "stop"}], "usage": {"completion_tokens": 3}},
                    {"choices": [{"text": "ba", "finish_reason": "length"}]}])
    fake = fakes(lambda path, body: (200, next(answers)), owned_by="me")
    server = connected(fake.url)
    one_stop = Decoding(8, 0.0, 1.0, (2,))
    reply = server.complete([1, 10], one_stop, 0, codec)
    assert (reply.ids, reply.cut, reply.retokenized, reply.round_trip) == ([12, 2], False, True, True)
    path, body = fake.requests[-1]
    assert path == "/v1/completions" and body["prompt"] == "<s>a" and body["model"] == "target"
    assert (body["top_k"], body["min_p"], body["repeat_penalty"]) == (0, 0.0, 1.0)   # llama.cpp's defaults off
    # the engine counted 3 tokens (2 with its stop) where the re-tokenization has 1: not the engine's tokens
    assert not server.complete([1, 10], one_stop, 0, codec).round_trip
    reply = server.complete([1, 10], one_stop, 0, codec)
    assert (reply.ids, reply.cut) == ([11, 10], True)
    assert (server.retokenized, server.mismatched) == (3, 1)
    with pytest.raises(EngineError, match=f"{fake.url} returns text only: .*exactly one stop token"):
        server.complete([1, 10], GREEDY, 0, codec)


def test_served_model_is_checked(fakes):
    fake = fakes(lambda path, body: (200, {}), models=("kimi", "kimi-lora"))
    with pytest.raises(EngineError) as e:
        connected(fake.url, "qwen")
    assert str(e.value) == f"{fake.url} serves kimi, kimi-lora, not 'qwen' (generate.served_model)"
    with pytest.raises(EngineError, match=f"{fake.url} serves kimi, kimi-lora; set generate.served_model to one"):
        connected(fake.url)
    assert connected(fake.url, "kimi-lora").model == "kimi-lora"
    fake.models = {"object": "list", "data": []}
    with pytest.raises(EngineError, match=f"{fake.url}/v1/models lists no model"):
        connected(fake.url)


def test_bad_answers_are_one_line_naming_the_server(fakes):
    fake = fakes(lambda path, body: (200, b"<html>hello</html>"))
    server = connected(fake.url)
    cases = [((200, b"<html>hello</html>"), f"{fake.url}/v1/completions answered with something that is not JSON"),
             ((200, vllm_answer([1], token_ids=None)),
              f"{fake.url}: vLLM answered without choices[0].token_ids: the reply's token ids (return_token_ids) need "
              "vLLM >= 0.10.2"),
             ((400, {"error": {"message": "This model's maximum context length is 10 tokens", "type": "BadRequestError",
                               "param": None, "code": 400}}),
              f"HTTP 400 from {fake.url}/v1/completions: This model's maximum context length is 10 tokens"),
             ((200, vllm_answer([1], "unheard-of")), "finish_reason 'unheard-of'; expected \"stop\" or \"length\""),
             ((200, {"choices": []}), f"{fake.url}: /v1/completions answered without choices")]
    for answer, message in cases:
        fake.answer = lambda path, body: answer
        with pytest.raises(EngineError) as e:
            server.complete([1], GREEDY, 0, None)
        assert message in str(e.value) and "\n" not in str(e.value), str(e.value)
    assert server.retries == 0   # none of these is retried


def test_5xx_and_aborts_are_retried_with_backoff(fakes):
    answers = iter([(503, {"error": {"message": "busy"}}), (200, vllm_answer([5], "abort")), (200, vllm_answer([5, 2]))])
    fake = fakes(lambda path, body: next(answers))
    server = connected(fake.url)
    assert server.complete([1], GREEDY, 0, None).ids == [5, 2] and server.retries == 2


def test_pool_drops_a_refusing_server_and_keeps_input_order(fakes, capsys):
    fake = fakes(lambda path, body: (200, vllm_answer([body["prompt"][0] * 10, 2])))
    dead = refusing_url()
    pool = Pool([dead, fake.url], None, 4, FAST)
    err = capsys.readouterr().err
    assert err == f"warning: {dead} dropped after 2 retries ({dead}/v1/models: [Errno 111] Connection refused); " \
                  "the other servers go on\n"
    assert [s.url for s in pool.servers] == [fake.url] and pool.kind == "vllm"
    items = list(range(1, 30))
    out = list(pool.run(items, lambda server, i: server.complete([i], GREEDY, 0, None).ids))
    assert out == [[i * 10, 2] for i in items]
    with pytest.raises(EngineError, match="no server answers \\(the last: http://127.0.0.1:.*Connection refused"):
        Pool([refusing_url()], None, 1, FAST)


def test_work_of_a_server_that_goes_down_moves_to_the_others(fakes, capsys):
    healthy = fakes(lambda path, body: (200, vllm_answer([body["prompt"][0], 2])))
    calls = []

    def failing(path, body):
        calls.append(body)
        return (200, vllm_answer([body["prompt"][0], 2])) if len(calls) <= 3 else (500, {"error": {"message": "dead"}})
    sick = fakes(failing)
    pool = Pool([sick.url, healthy.url], None, 2, FAST)
    out = list(pool.run(list(range(40)), lambda server, i: server.complete([i], GREEDY, 0, None).ids))
    assert out == [[i, 2] for i in range(40)]
    assert pool.servers[0].dropped and not pool.servers[1].dropped
    assert f"warning: {sick.url} dropped after 2 retries (HTTP 500 from {sick.url}/v1/completions: dead)" \
           in capsys.readouterr().err
    # every server down: one line naming the last error
    pool = Pool([sick.url], None, 2, FAST)
    with pytest.raises(EngineError, match=f"every server is down \\(the last: HTTP 500 from {sick.url}"):
        list(pool.run(list(range(5)), lambda server, i: server.complete([i], GREEDY, 0, None).ids))


def test_servers_of_different_engines_are_refused(fakes):
    a, b = fakes(lambda *_: (200, {})), fakes(lambda *_: (200, {}), owned_by="sglang")
    with pytest.raises(EngineError, match="the servers run different engines .*regenerate with one kind at a time"):
        Pool([a.url, b.url], None, 1, FAST)


# --- generate through servers ----------------------------------------------------------------------------------

STOPS = list(range(3, 256, 9))   # stops often enough that replies end both ways


@pytest.fixture(scope="module")
def turns(tmp_path_factory):
    """Pre-tokenized conversations of two replies each."""
    path = tmp_path_factory.mktemp("turns") / "data.jsonl"
    g = torch.Generator().manual_seed(5)
    with path.open("w") as f:
        for i in range(9):
            lens = [3 + i, 6, 4, 6]
            ids = torch.randint(3, 256, (sum(lens),), generator=g).tolist()
            f.write(json.dumps({"input_ids": ids, "loss_mask": [0] * lens[0] + [1] * 6 + [0] * 4 + [1] * 6}) + "\n")
    return path


TARGET = threading.Lock()   # the fakes of one test share a target, whose cache pool takes one pass at a time


def engine_of(target, kind):
    """A fake vLLM or SGLang whose replies are the target's greedy decoding, through the stop token."""
    def answer(path, body):
        prompt, params = (body["prompt"], body) if kind == "vllm" else (body["input_ids"], body["sampling_params"])
        limit = params.get("max_tokens", params.get("max_new_tokens"))
        with TARGET:
            ids = greedy_decode_many(target, [prompt], limit, set(params["stop_token_ids"]))[0].tokens
        stopped = ids[-1] in params["stop_token_ids"]
        if kind == "vllm":
            return 200, vllm_answer(ids, "stop" if stopped else "length")
        return 200, sglang_answer(ids, {"type": "stop", "matched": ids[-1]} if stopped else {"type": "length"})
    return answer


def config(tmp_path, llama_target, turns, **overrides):
    return make_config(tmp_path, llama_target, turns, **{
        "generate.output_path": tmp_path / "regen.jsonl", "generate.max_new_tokens": 5, "generate.temperature": 0.0,
        "debug.stop_token_ids": json.dumps(STOPS), "debug.generate_dtype": "float32", "debug.generate_device": "cpu",
        "debug.generate_retries": 1, "debug.generate_retry_wait_s": 0.01, "debug.generate_requests": 3, **overrides})


@pytest.mark.parametrize("kind", ["vllm", "sglang"])
def test_generate_through_servers_writes_the_engines_ids(tmp_path, llama_target, turns, fakes, kind, capsys):
    """Greedy replies from an engine that runs the target are the ones our own loop writes, cut replies marked."""
    target = IncrementalTarget(Checkpoint(llama_target), [0, 0, 0], torch.device("cpu"), torch.float32)
    generate.run(config(tmp_path / "local", llama_target, turns))
    own = (tmp_path / "local" / "regen.jsonl").read_text()
    a, b = fakes(engine_of(target, kind), owned_by=kind), fakes(engine_of(target, kind), owned_by=kind)
    cfg = config(tmp_path, llama_target, turns, **{"generate.servers": json.dumps([a.url, b.url])})
    generate.run(cfg)
    assert (tmp_path / "regen.jsonl").read_text() == own
    lines = [json.loads(x) for x in own.splitlines()]
    cut = sum(len(x["cut_replies"]) for x in lines)
    assert 0 < cut < 2 * len(lines), "the data should end replies both at a stop token and at the limit"
    for line in lines:
        for k, (start, end) in enumerate(generate.reply_spans(line["loss_mask"])):
            assert (line["input_ids"][end - 1] in STOPS) == (k not in line["cut_replies"])
    assert a.requests and b.requests   # both servers took requests
    summary = capsys.readouterr().out.splitlines()[-1]
    assert f"this run: {2 * len(lines)} replies in {len(lines)} sequences" in summary
    assert f"({cut} cut at generate.max_new_tokens)" in summary and "0 retries" in summary


def test_generate_resumes_after_the_servers_die(tmp_path, llama_target, turns, fakes, capsys):
    target = IncrementalTarget(Checkpoint(llama_target), [0, 0, 0], torch.device("cpu"), torch.float32)
    healthy = engine_of(target, "vllm")
    served = []

    def dies(path, body):
        served.append(1)
        return healthy(path, body) if len(served) <= 7 else (502, {"error": {"message": "gone"}})
    sick = fakes(dies)
    cfg = config(tmp_path, llama_target, turns, **{"generate.servers": json.dumps([sick.url]),
                                                   "debug.generate_requests": 1})
    with pytest.raises(EngineError) as e:
        generate.run(cfg)
    partial = tmp_path / "regen.jsonl.partial"
    assert str(e.value) == (f"every server is down (the last: HTTP 502 from {sick.url}/v1/completions: gone); the "
                            f"replies so far are kept in {partial}: the same command resumes")
    kept = partial.read_text().splitlines()
    assert len(kept) == 3   # 7 replies answered: 3 whole conversations written in order, the 4th's first reply lost
    fresh = fakes(healthy)
    cfg.generate.servers = [fresh.url]   # another server list: the settings recorded are the same
    generate.run(cfg)
    whole = (tmp_path / "regen.jsonl").read_text().splitlines()
    assert whole[:3] == kept and [json.loads(x)["source_line"] for x in whole] == list(range(1, 10))
    assert len(fresh.requests) == 2 * 6   # nothing asked twice
    generate.run(config(tmp_path / "local", llama_target, turns))
    assert whole == (tmp_path / "local" / "regen.jsonl").read_text().splitlines()


def test_generate_with_bad_servers_stops_in_one_line(tmp_path, llama_target, turns, fakes, capsys):
    from eagle3.__main__ import main
    wrong = fakes(lambda *_: (200, {}), models=("other",))
    old = fakes(lambda path, body: (200, vllm_answer([1], token_ids=None)))
    text = fakes(lambda path, body: (200, b"Internal Server Error, not JSON"))
    cases = [(refusing_url(), "no server answers (the last: "),
             (wrong.url, f"{wrong.url} serves other, not 'target' (generate.served_model)"),
             (old.url, f"{old.url}: vLLM answered without choices[0].token_ids"),
             (text.url, f"{text.url}/v1/completions answered with something that is not JSON")]
    for url, message in cases:
        out = tmp_path / url.split(":")[-1] / "regen.jsonl"
        args = ["generate", "--config", str(ROOT / "config.toml")]
        for key, value in {"target.path": llama_target, "data.path": turns, "generate.output_path": out,
                           "generate.servers": json.dumps([url]), "generate.served_model": "target",
                           "debug.generate_retries": 1, "debug.generate_retry_wait_s": 0.01}.items():
            args += [f"--{key}", str(value)]
        with pytest.raises(SystemExit) as e:
            main(args)
        assert str(e.value.code).startswith(f"error: {message}") and "\n" not in str(e.value.code), e.value.code
        assert not out.exists() and (not out.with_name("regen.jsonl.partial").exists()
                                     or not out.with_name("regen.jsonl.partial").read_text())
