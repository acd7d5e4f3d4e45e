"""Replies from serving engines over HTTP, no engine imported: vLLM's /v1/completions and SGLang's native /generate
take token ids and give back the engine's own output ids; any other OpenAI-compatible server gives back text, which
is re-tokenized; conversations with images or video go through vLLM's or SGLang's /v1/chat/completions. Several
servers at once with requests in flight on each, retries with backoff, a server that stays down dropped while the
others go on (docs/generate.md)."""
from __future__ import annotations

import collections
import http.client
import json
import queue
import re
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from eagle3.errors import Eagle3Error

KINDS = {"vllm": "vLLM", "sglang": "SGLang"}   # /v1/models' owned_by -> the engine; anything else answers text only
VLLM_TOKEN_IDS = "0.10.2"                      # the first vLLM whose /v1/completions returns the reply's token ids


class EngineError(Eagle3Error):
    """A server that cannot be used as it answers; the message names the server and the problem."""


class Retryable(Exception):
    """A connection error, a timeout or a 5xx answer: the same request may succeed later."""


class ServerDown(Exception):
    """A server that failed every retry; the request goes to another server."""


@dataclass(frozen=True)
class Decoding:
    """How each reply is sampled: as our own loop samples (temperature and top_p alone, no top_k, min_p or penalty)."""
    max_new_tokens: int
    temperature: float
    top_p: float
    stop: tuple[int, ...]


@dataclass
class Reply:
    ids: list[int]              # the reply's tokens; they end with the stop token unless `cut`
    cut: bool                   # stopped at max_new_tokens (or the server's context length)
    retokenized: bool = False   # from a text-only server: its text encoded again by the target's tokenizer
    round_trip: bool = True     # retokenized: the text survived decode(encode(text)) and the engine's token count


@dataclass
class ChatReply:
    message: dict               # the assistant turn: content, reasoning_content, tool_calls as the engine parsed them
    cut: bool                   # stopped at max_new_tokens (or the server's context length)
    tokens: int                 # the engine's count of the reply's tokens (usage.completion_tokens)


@dataclass
class Retry:
    attempts: int          # retries after the first try
    wait_s: float          # the first wait; it doubles at each retry
    timeout_s: float       # seconds one request may take


def http_json(url: str, body: dict | None, timeout: float) -> object:
    """GET (no body) or POST `body` as JSON; the answer's JSON. Retryable: no answer, or a 5xx/429 one."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as answer:
            raw = answer.read()
    except urllib.error.HTTPError as e:
        message = f"HTTP {e.code} from {url}: {_error_text(e)}"
        if e.code == 429 or e.code >= 500 and e.code != 501:   # busy or failing; 501: it has no such API, an answer
            raise Retryable(message) from None
        raise EngineError(message) from None
    except (urllib.error.URLError, http.client.HTTPException, OSError) as e:   # refused, reset, timed out
        raise Retryable(f"{url}: {getattr(e, 'reason', None) or e}") from None
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise EngineError(f"{url} answered with something that is not JSON: {raw[:120]!r}") from None


def _error_text(e: urllib.error.HTTPError) -> str:
    """The message of an error answer, on one line: vLLM's {"error": {"message"}}, the flat {"message"}; for one that
    is not JSON (a web page), its title and what was expected instead of its body."""
    try:
        raw = e.read()
    except OSError:
        return str(e.reason)
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        title = re.search(rb"<title>(.*?)</title>", raw, re.S | re.I)
        page = f"a web page ({' '.join(title[1].decode(errors='replace').split())[:80]!r})" if title else \
            f"{len(raw)} bytes that are not JSON"
        return f"{page}; expected the JSON of an LLM server (vLLM, SGLang or another OpenAI-compatible one)"
    inner = body.get("error", body) if isinstance(body, dict) else body
    return " ".join(str(inner.get("message", inner) if isinstance(inner, dict) else inner).split())[:300]


def base_url(url: str) -> str:
    """The server's root: an OpenAI client's base URL ends in /v1, which the paths here add themselves."""
    url = url.rstrip("/")
    return url[:-3] if url.endswith("/v1") else url


class Server:
    """One engine behind a base URL: its kind and served model (from /v1/models), its requests with retries."""

    def __init__(self, url: str, retry: Retry):
        self.url, self.retry = base_url(url), retry
        self.kind, self.model, self.context = "text", "", None
        self.dropped, self.error = False, ""
        self.retries = self.tokens = self.replies = self.retokenized = self.mismatched = 0
        self.lock = threading.Lock()

    def call(self, path: str, body: dict | None = None, read: Callable[[object], object] = lambda a: a) -> object:
        """read(the answer to one request), retried with backoff (`read` may ask for it: Retryable); ServerDown once
        the retries are spent."""
        attempt = 0
        while not self.dropped:   # another request found it down: this one goes elsewhere at once
            try:
                return read(http_json(self.url + path, body, self.retry.timeout_s))
            except Retryable as e:
                self.error = str(e)
                if attempt == self.retry.attempts:
                    break
            with self.lock:
                self.retries += 1
            time.sleep(self.retry.wait_s * 2 ** attempt)
            attempt += 1
        raise ServerDown(self.error)

    def connect(self, wanted: str | None) -> None:
        """Find the engine and check the served model (`wanted`; None: the only one listed)."""
        listed = self.call("/v1/models")
        data = listed.get("data") if isinstance(listed, dict) else None
        models = [m for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)] if isinstance(data, list) else []
        if not models:
            raise EngineError(f"{self.url}/v1/models lists no model; expected {{\"data\": [{{\"id\": ...}}]}}")
        names = [m["id"] for m in models]
        if wanted is None and len(names) > 1:
            raise EngineError(f"{self.url} serves {', '.join(names)}; set generate.served_model to one of them")
        if wanted is not None and wanted not in names:
            raise EngineError(f"{self.url} serves {', '.join(names)}, not {wanted!r} (generate.served_model)")
        entry = models[names.index(wanted) if wanted is not None else 0]
        self.model = entry["id"]
        self.kind = entry.get("owned_by") if entry.get("owned_by") in KINDS else "text"
        length = entry.get("max_model_len")
        self.context = length if isinstance(length, int) and not isinstance(length, bool) and length > 0 else None

    def describe(self) -> str:
        return f"{self.url} ({KINDS.get(self.kind, 'text only')}, {self.model})"

    def _limit(self, prompt: int, decoding: Decoding) -> int:
        """The reply's most tokens after a prompt of `prompt` tokens: max_new_tokens within the server's context."""
        limit = decoding.max_new_tokens
        if self.context is not None:
            limit = min(limit, self.context - prompt)
            if limit <= 0:
                raise EngineError(f"{self.url}: a prompt of {prompt} tokens leaves no room for a reply within "
                                  f"the server's max_model_len {self.context}")
        return limit

    @staticmethod
    def _sampling(decoding: Decoding, seed: int) -> dict:
        sampling = {"temperature": decoding.temperature, "top_p": decoding.top_p, "presence_penalty": 0.0,
                    "frequency_penalty": 0.0}
        if decoding.temperature > 0:   # greedy needs none, and an older SGLang refuses its seed field
            sampling["seed"] = seed
        return sampling

    def _count(self, reply: Reply | ChatReply) -> None:
        with self.lock:
            self.tokens += reply.tokens if isinstance(reply, ChatReply) else len(reply.ids)
            self.replies += 1
            if isinstance(reply, Reply):
                self.retokenized += reply.retokenized
                self.mismatched += not reply.round_trip

    def chat(self, request: dict, prompt: int, decoding: Decoding, seed: int) -> ChatReply:
        """The assistant message answering `request` ({"messages", "tools", "chat_template_kwargs"}: media parts as
        data: URLs) through vLLM's or SGLang's chat API, the turn as the engine's parsers give it; `prompt`: its
        tokens."""
        # vLLM's and SGLang's chat requests take the same sampling fields; special tokens kept, as the token-id paths
        body = {"model": self.model, **request, "max_tokens": self._limit(prompt, decoding),
                **self._sampling(decoding, seed), "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0,
                "stop_token_ids": list(decoding.stop), "skip_special_tokens": False}

        def read(answer: object) -> ChatReply:
            choice = self._choice(answer, "/v1/chat/completions")
            message = choice.get("message")
            if not isinstance(message, dict) or not isinstance(message.get("content"), (str, type(None))):
                raise EngineError(f"{self.url}: /v1/chat/completions answered without choices[0].message.content: "
                                  f"{str(choice)[:200]}")
            turn = {"role": "assistant", "content": message["content"]}
            # later vLLM names the parser's reasoning `reasoning`, SGLang and earlier vLLM `reasoning_content`
            if reasoning := message.get("reasoning_content") or message.get("reasoning"):
                turn["reasoning_content"] = reasoning
            if message.get("tool_calls"):
                turn["tool_calls"] = message["tool_calls"]
            counted = (answer.get("usage") or {}).get("completion_tokens")
            return ChatReply(turn, self._finish(choice.get("finish_reason")) == "length",
                             counted if isinstance(counted, int) else 0)
        reply = self.call("/v1/chat/completions", body, read)
        self._count(reply)
        return reply

    def complete(self, prompt: list[int], decoding: Decoding, seed: int, text: TextCodec | None) -> Reply:
        """The reply to `prompt` (the conversation's ids through the generation prompt)."""
        limit, sampling = self._limit(len(prompt), decoding), self._sampling(decoding, seed)
        if self.kind == "vllm":
            reply = self._vllm(prompt, decoding, limit, sampling)
        elif self.kind == "sglang":
            reply = self._sglang(prompt, decoding, limit, sampling)
        else:
            reply = self._text(prompt, decoding, limit, sampling, text)
        self._count(reply)
        return reply

    def _vllm(self, prompt: list[int], decoding: Decoding, limit: int, sampling: dict) -> Reply:
        body = {"model": self.model, "prompt": prompt, "max_tokens": limit, **sampling, "top_k": -1, "min_p": 0.0,
                "repetition_penalty": 1.0, "stop_token_ids": list(decoding.stop), "skip_special_tokens": False,
                "return_token_ids": True}

        def read(answer: object) -> Reply:
            choice = self._choice(answer)
            if choice.get("token_ids") is None:
                raise EngineError(f"{self.url}: vLLM answered without choices[0].token_ids: the reply's token ids "
                                  f"(return_token_ids) need vLLM >= {VLLM_TOKEN_IDS}")
            cut = self._finish(choice.get("finish_reason")) == "length"
            # they end with the stop token vLLM stopped at (its detokenizer skips that id, then appends it back)
            return Reply(self._ids(choice["token_ids"], "choices[0].token_ids"), cut)
        return self.call("/v1/completions", body, read)

    def _sglang(self, prompt: list[int], decoding: Decoding, limit: int, sampling: dict) -> Reply:
        params = {"max_new_tokens": limit, **sampling, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0,
                  "stop_token_ids": list(decoding.stop), "skip_special_tokens": False, "no_stop_trim": True}
        if "seed" in params:
            params["sampling_seed"] = params.pop("seed")

        def read(answer: object) -> Reply:
            if not isinstance(answer, dict) or "output_ids" not in answer:
                raise EngineError(f"{self.url}: SGLang's /generate answered without output_ids: {str(answer)[:200]}")
            ids = self._ids(answer["output_ids"], "output_ids")
            reason = (answer.get("meta_info") or {}).get("finish_reason")
            kind = self._finish(reason.get("type") if isinstance(reason, dict) else reason, reason)
            matched = reason.get("matched") if isinstance(reason, dict) else None
            if kind == "stop" and isinstance(matched, int) and (not ids or ids[-1] != matched):
                ids.append(matched)   # output_ids run through the stop token; a version that trims it gets it back
            return Reply(ids, kind == "length")
        return self.call("/generate", {"input_ids": prompt, "sampling_params": params}, read)

    def _text(self, prompt: list[int], decoding: Decoding, limit: int, sampling: dict, text: TextCodec | None) -> Reply:
        if text is None or len(decoding.stop) != 1:
            raise EngineError(f"{self.url} returns text only: its replies are re-tokenized, which needs the target's "
                              "tokenizer and exactly one stop token to end them with (debug.stop_token_ids = "
                              f"{list(decoding.stop)})")
        # no token ids in or out: the prompt as text, and the knobs llama.cpp-style servers default on turned off
        body = {"model": self.model, "prompt": text.decode(prompt), "max_tokens": limit, **sampling, "top_k": 0,
                "min_p": 0.0, "repeat_penalty": 1.0}

        def read(answer: object) -> Reply:
            choice = self._choice(answer)
            if not isinstance(reply := choice.get("text"), str):
                raise EngineError(f"{self.url}: /v1/completions answered without choices[0].text")
            stopped = self._finish(choice.get("finish_reason")) == "stop"
            ids = text.encode(reply)
            counted = (answer.get("usage") or {}).get("completion_tokens")
            # the engine's own token count tells a re-tokenization that cut the text otherwise (a stop may count)
            same = text.decode(ids) == reply and (not isinstance(counted, int) or counted in (len(ids), len(ids) + stopped))
            return Reply(ids + [decoding.stop[0]] * stopped, not stopped, retokenized=True, round_trip=same)
        return self.call("/v1/completions", body, read)

    def _choice(self, answer: object, path: str = "/v1/completions") -> dict:
        choices = answer.get("choices") if isinstance(answer, dict) else None
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            raise EngineError(f"{self.url}: {path} answered without choices: {str(answer)[:200]}")
        return choices[0]

    def _ids(self, ids: object, name: str) -> list[int]:
        if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise EngineError(f"{self.url}: {name} is not a list of token ids: {str(ids)[:200]}")
        return list(ids)

    def _finish(self, reason: object, whole: object = None) -> str:
        """"stop" or "length" ("tool_calls": a chat reply that stopped after its calls); an aborted request is retried
        unless the server says the request was wrong (4xx)."""
        if reason in ("stop", "length", "tool_calls"):
            return "length" if reason == "length" else "stop"
        status = whole.get("status_code") if isinstance(whole, dict) else None
        if reason in ("abort", "error") and not (isinstance(status, int) and 400 <= status < 500):
            raise Retryable(f"{self.url}: the request ended with finish_reason {whole or reason}")
        raise EngineError(f"{self.url}: finish_reason {whole or reason!r}; expected \"stop\" or \"length\"")


class TextCodec:
    """What a text-only server needs of the target's tokenizer: ids to text and back."""

    def __init__(self, encode: Callable[[str], list[int]], decode: Callable[[list[int]], str]):
        self.encode, self.decode = encode, decode


class Pool:
    """Several servers, `per_server` requests in flight on each (threads), results in input order."""

    def __init__(self, urls: list[str], model: str | None, per_server: int, retry: Retry):
        """Connect: a server that does not answer /v1/models is dropped with one line; none answering stops."""
        self.servers, self.per_server, self.last_error = [Server(url, retry) for url in urls], per_server, ""
        for server in self.servers:
            try:
                server.connect(model)
            except ServerDown:
                self.drop(server)
        self.servers = [s for s in self.servers if not s.dropped]
        if not self.servers:
            raise EngineError(f"no server answers (the last: {self.last_error})")
        if len(kinds := {s.kind for s in self.servers}) > 1:
            raise EngineError(f"the servers run different engines ({', '.join(s.describe() for s in self.servers)}); "
                              f"regenerate with one kind at a time ({', '.join(sorted(kinds))})")
        self.started = time.monotonic()

    @property
    def kind(self) -> str:
        return self.servers[0].kind

    def drop(self, server: Server) -> None:
        """Stop sending to `server`, saying so once."""
        with server.lock:
            if server.dropped:
                return
            server.dropped, self.last_error = True, server.error
        print(f"warning: {server.url} dropped after {server.retry.attempts} retries ({server.error}); "
              f"{'the other servers go on' if any(not s.dropped for s in self.servers) else 'no server is left'}",
              file=sys.stderr)

    def run(self, items: list, work: Callable[[Server, object], object]) -> Iterator[object]:
        """work(server, item) for each item, yielded in input order. An item whose server goes down (ServerDown)
        goes to the others; any other error stops all, and so does the last server going down (EngineError)."""
        todo, done = collections.deque(enumerate(items)), queue.Queue()
        state = {"busy": 0, "stop": False}
        ready = threading.Condition()

        def slot(server: Server) -> None:
            while True:
                with ready:   # an idle slot waits while items are out: one may come back from a server gone down
                    while not todo and state["busy"] and not state["stop"]:
                        ready.wait()
                    if state["stop"] or server.dropped or not todo:
                        return
                    index, item = todo.popleft()
                    state["busy"] += 1
                try:
                    done.put((index, work(server, item), None))
                except ServerDown:
                    with ready:
                        todo.appendleft((index, item))   # first in line: the output stays in input order
                        if state["stop"]:                # the run is over: a server gone since does not matter
                            return
                    self.drop(server)
                    done.put((None, None, None))
                    return
                except BaseException as e:   # noqa: BLE001 - the main thread raises it
                    done.put((index, None, e))
                    return
                finally:
                    with ready:
                        state["busy"] -= 1
                        ready.notify_all()

        for server in self.servers:
            for _ in range(self.per_server):
                threading.Thread(target=slot, args=(server,), daemon=True).start()
        waiting, following = {}, 0
        try:
            while following < len(items):
                index, result, error = done.get()
                if error is not None:
                    raise error
                if index is None and all(s.dropped for s in self.servers):
                    raise EngineError(f"every server is down (the last: {self.last_error})")
                if index is not None:
                    waiting[index] = result
                while following in waiting:
                    yield waiting.pop(following)
                    following += 1
        finally:
            with ready:
                state["stop"] = True
                ready.notify_all()

    def rates(self) -> dict[str, str]:
        """Tokens per second of each server since the start, for the progress bar."""
        seconds = max(time.monotonic() - self.started, 1e-9)
        return {s.url.split("//")[-1]: "down" if s.dropped else f"{s.tokens / seconds:.0f} tok/s" for s in self.servers}

    @property
    def retries(self) -> int:
        return sum(s.retries for s in self.servers)

    @property
    def replies(self) -> int:
        return sum(s.replies for s in self.servers)

    @property
    def tokens(self) -> int:
        return sum(s.tokens for s in self.servers)

    @property
    def retokenized(self) -> int:
        return sum(s.retokenized for s in self.servers)

    @property
    def mismatched(self) -> int:
        return sum(s.mismatched for s in self.servers)
