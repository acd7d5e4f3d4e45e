"""Chat lines (OpenAI {"messages"}, ShareGPT {"conversations"}) -> (input_ids, loss_mask) with the target's own
tokenizer and chat template, each assistant turn found by rendering prefix by prefix (docs/data.md)."""
from __future__ import annotations

import base64
import importlib
import json
import re
from collections.abc import Callable
from itertools import accumulate, chain
from pathlib import Path

import numpy as np

from eagle3.errors import Eagle3Error, InputError
from eagle3.files import read_json

# Kimi-K2's split pattern (tokenization_kimi.py): Han runs are pre-tokens of their own.
KIMI_PATTERN = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""", r""" ?[^\s\p{L}\p{N}]+[\r\n]*""", r"""\s*[\r\n]+""", r"""\s+(?!\S)""", r"""\s+""",
])
# Kimi cuts its input like this before tiktoken, whose regex engine panics on very long runs.
KIMI_MAX_TEXT, KIMI_MAX_RUN = 400_000, 25_000
OPENAI_ROLES = {"system": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
SHAREGPT_ROLES = {"system": "system", "human": "user", "gpt": "assistant"}
# The target files that decide how a conversation becomes tokens (hashed into the extraction plan).
TOKENIZER_FILES = ("tiktoken.model", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


class ChatError(Eagle3Error):
    """A conversation that cannot be encoded; the caller adds the file and line."""


def _require(module: str, needed_by: Path):
    try:
        return importlib.import_module(module)
    except ImportError:
        raise InputError(f"{needed_by}: chat lines need the optional package '{module}': "
                         "pip install eagle3-trainer[chat]") from None


def _text(content: object, where: str) -> str:
    if isinstance(content, list):
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
            raise ChatError(f"{where}: content parts must be {{\"type\": \"text\", \"text\": ...}}")
        content = "".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise ChatError(f"{where}: content must be a string or a list of text parts")
    if not content.strip():
        raise ChatError(f"{where}: empty content")
    return content


def conversation(obj: dict, require_reply: bool = True) -> list[dict]:
    """The line's turns as [{"role", "content": str}] in OpenAI roles (a prompt needs no reply)."""
    key = "messages" if "messages" in obj else "conversations"
    role_key, text_key, roles = (("role", "content", OPENAI_ROLES) if key == "messages"
                                 else ("from", "value", SHAREGPT_ROLES))
    turns = obj[key]
    if not isinstance(turns, list) or not turns:
        raise ChatError(f"'{key}' must be a non-empty list of turns")
    messages = []
    for number, turn in enumerate(turns, start=1):
        where = f"message {number} of {len(turns)}"
        role = turn.get(role_key) if isinstance(turn, dict) else None
        if not isinstance(role, str) or role not in roles:
            raise ChatError(f"{where}: unknown role {role!r}; expected '{role_key}' one of {sorted(roles)}")
        messages.append({"role": roles[role], "content": _text(turn.get(text_key), where)})
    if require_reply and not any(m["role"] == "assistant" for m in messages):
        raise ChatError(f"no assistant turn in '{key}': nothing to learn from")
    return messages


def _read_ranks(path: Path) -> dict[bytes, int]:
    ranks = {}
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except ValueError:
            raise InputError(f"{path}:{number}: expected '<base64 token> <rank>'") from None
    return ranks


def _cut(text: str, limit: int, pattern: str) -> list[str]:
    """`text` cut every `limit` characters inside each match of `pattern` longer than that."""
    cuts = [m.start() + j for m in re.finditer(pattern, text) for j in range(limit, len(m.group()), limit)]
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


def _special_tokens(model: Path, config_path: Path, config: dict) -> dict[str, int]:
    needed = f"{config_path}: 'added_tokens_decoder' ({{id: {{\"content\": ...}}}}) is needed with {model.name}"
    decoder = config.get("added_tokens_decoder")
    if not isinstance(decoder, dict) or not decoder:
        raise InputError(needed)
    try:
        return {entry["content"]: int(i) for i, entry in decoder.items()}
    except (KeyError, TypeError, ValueError):
        raise InputError(needed) from None


def _load_tokenizer(root: Path, config_path: Path, config: dict) -> Callable[[str], list[int]]:
    """The target's encode function: Kimi's tiktoken.model or a Hugging Face tokenizer.json. Neither adds
    special tokens (no BOS): the template writes what the model sees."""
    if (model := root / "tiktoken.model").exists():
        enc = _require("tiktoken", model).Encoding(name=model.name, pat_str=KIMI_PATTERN,
                                                   mergeable_ranks=_read_ranks(model),
                                                   special_tokens=_special_tokens(model, config_path, config))
        return lambda text: [t for chunk in _cut(text, KIMI_MAX_TEXT, r"(?s).+")
                             for piece in _cut(chunk, KIMI_MAX_RUN, r"\s+|\S+")
                             for t in enc.encode(piece, allowed_special="all")]
    if (path := root / "tokenizer.json").exists():
        tokenizers = _require("tokenizers", path)
        try:
            tok = tokenizers.Tokenizer.from_file(str(path))
        except Exception as e:  # the Rust library raises a bare Exception for a file it cannot read
            raise InputError(f"{path}: not a tokenizers file: {e}") from None
        return lambda text: tok.encode(text, add_special_tokens=False).ids
    raise InputError(f"{root}: chat lines need the target's tokenizer: expected tiktoken.model + "
                     "tokenizer_config.json (Kimi) or tokenizer.json in the target directory")


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # Hugging Face's variant: jinja2's own tojson HTML-escapes, which would change the prompt text
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise ChatError(f"chat template: {message}")


def _load_template(root: Path, config_path: Path, config: dict):
    path = root / "chat_template.jinja"
    source, origin = (path.read_text(), path) if path.exists() else (config.get("chat_template"), config_path)
    if isinstance(source, list):  # named templates: [{"name": "default", "template": ...}, ...]
        source = next((t.get("template") for t in source if t.get("name") == "default"), None)
    if not isinstance(source, str):
        raise InputError(f"{root}: chat lines need the target's chat template: expected chat_template.jinja "
                         f"or 'chat_template' in {config_path.name}")
    jinja2 = _require("jinja2", origin)
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    # as transformers renders templates; no strftime_now: a resumed extraction tokenizes exactly as before
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise InputError(f"{origin}:{e.lineno}: chat template syntax error: {e.message}") from None


def _token_text(value: object) -> str:
    return value.get("content", "") if isinstance(value, dict) else value or ""


def _json_object(path: Path) -> dict:
    value = read_json(path, InputError, "") if path.exists() else {}
    if not isinstance(value, dict):
        raise InputError(f"{path}: expected a JSON object")
    return value


def _token_id(root: Path, content: str) -> int | None:
    """The id of token `content` in the target's tokenizer files (special tokens, then the vocabulary)."""
    config = _json_object(root / "tokenizer_config.json")
    for i, entry in (config.get("added_tokens_decoder") or {}).items():
        if isinstance(entry, dict) and entry.get("content") == content:
            return int(i)
    tok = _json_object(root / "tokenizer.json")
    for entry in tok.get("added_tokens") or []:
        if isinstance(entry, dict) and entry.get("content") == content:
            return entry.get("id")
    vocab = (tok.get("model") or {}).get("vocab")
    return vocab.get(content) if isinstance(vocab, dict) else None


def stop_token_ids(root: str | Path, config_eos: object) -> set[int]:
    """The tokens an engine stops at, as vLLM finds them: the tokenizer's eos token and
    generation_config.json's eos_token_id, else config.json's (`config_eos`)."""
    root = Path(root)
    generation = root / "generation_config.json"
    eos = _json_object(generation).get("eos_token_id") if generation.exists() else config_eos
    stop = eos if isinstance(eos, list) else [] if eos is None else [eos]
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in stop):
        raise InputError(f"{generation if generation.exists() else root / 'config.json'}: eos_token_id = {eos!r}; "
                         "expected an integer or a list of integers")
    token = next((t for name in ("tokenizer_config.json", "special_tokens_map.json")
                  if (t := _token_text(_json_object(root / name).get("eos_token")))), None)
    if token and (i := _token_id(root, token)) is not None:
        stop = [*stop, i]
    return set(stop)


class ChatEncoder:
    """Encodes chat lines for one target directory; loading problems raise InputError."""

    def __init__(self, target_dir: str | Path):
        root = Path(target_dir)
        config_path = root / "tokenizer_config.json"
        config = _json_object(config_path)
        self.encode_text = _load_tokenizer(root, config_path, config)
        self.template = _load_template(root, config_path, config)
        self.variables = {"bos_token": _token_text(config.get("bos_token")),
                          "eos_token": _token_text(config.get("eos_token"))}

    def encode(self, obj: dict) -> tuple[np.ndarray, np.ndarray]:
        """int32 ids and uint8 loss mask of a {"messages"} or {"conversations"} line."""
        messages = conversation(obj)
        text, spans = self._render(messages)
        ids, cuts = self._token_cuts(text, [b for span in spans for b in span])
        mask = np.zeros(len(ids), dtype=np.uint8)
        replies = [k for k, m in enumerate(messages) if m["role"] == "assistant"]
        for k, start, end in zip(replies, cuts[0::2], cuts[1::2]):
            if start == end:
                raise ChatError(f"message {k + 1} of {len(messages)} (assistant) renders to no tokens")
            mask[start:end] = 1
        return np.asarray(ids, dtype=np.int32), mask

    def encode_prompt(self, obj: dict) -> np.ndarray:
        """int32 ids of a chat line as a prompt: a trailing assistant turn dropped, the generation prompt added."""
        messages = conversation(obj, require_reply=False)
        if messages[-1]["role"] == "assistant":
            messages = messages[:-1]
        if not messages:
            raise ChatError("only an assistant turn: no prompt to reply to")
        return np.asarray(self.encode_text(self._apply(messages, add_generation_prompt=True)), dtype=np.int32)

    def _apply(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        try:
            return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                        **self.variables)
        except ChatError:
            raise
        except Exception as e:  # a template is third-party code: whatever it raises is this line's problem
            raise ChatError(f"chat template failed: {type(e).__name__}: {e}") from None

    def _render(self, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
        """The conversation's text and the character span [start, end) of each assistant reply."""
        before, spans = "", []
        for k, message in enumerate(messages):
            text = self._apply(messages[:k + 1])
            _check_extends(before, text, f"the chat template renders messages 1..{k} differently once "
                                         f"message {k + 1} follows")
            if message["role"] == "assistant":
                prompt = self._apply(messages[:k], add_generation_prompt=True)
                _check_extends(before, prompt, "the chat template's generation prompt changes earlier turns")
                _check_extends(prompt, text, f"message {k + 1} (assistant) does not start with the chat "
                                             "template's generation prompt")
                spans.append((len(prompt), max(len(prompt), len(text.rstrip()))))
            before = text
        return before, spans

    def _token_cuts(self, text: str, bounds: list[int]) -> tuple[list[int], list[int]]:
        """Token ids of `text` and, per character position in `bounds`, the tokens before it. The pieces
        between bounds are tokenized apart, as an engine sees prompt and reply (docs/data.md)."""
        ids = self.encode_text(text)
        edges = [0, *bounds, len(text)]
        pieces = [self.encode_text(text[a:b]) for a, b in zip(edges, edges[1:])]
        joined = list(chain.from_iterable(pieces))
        if joined != ids:   # a piece alone encodes differently (a SentencePiece prefix space): cut by prefixes
            heads = [self.encode_text(text[:b]) for b in bounds]
            if all(h == ids[:len(h)] for h in heads):   # each prefix tokenizes as the start of the whole
                return ids, [len(h) for h in heads]
        return joined, list(accumulate(len(p) for p in pieces[:-1]))


def _check_extends(prefix: str, text: str, problem: str) -> None:
    if not text.startswith(prefix):
        raise ChatError(f"{problem}, so the assistant tokens cannot be located by rendering prefixes")
