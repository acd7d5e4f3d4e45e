"""Chat conversations -> (input_ids, loss_mask) with the target's own tokenizer and chat template.

Formats of a line:
  {"messages": [{"role": "system"|"user"|"assistant"|"tool", "content": ...}, ...]}   (OpenAI)
  {"conversations": [{"from": "system"|"human"|"gpt", "value": ...}, ...]}            (ShareGPT)
Content is a string or a list of {"type": "text", "text": ...} parts (joined).

Tokenizer: Kimi's `tiktoken.model` + `tokenizer_config.json` (extra `tiktoken`) or a Hugging Face
`tokenizer.json` (extra `tokenizers`). Template: `chat_template.jinja`, else `chat_template` in
`tokenizer_config.json`, rendered in a jinja2 sandbox (extra `jinja2`).

Loss mask: an assistant turn's tokens after the template's generation prompt (what the target
emits when asked to reply) up to and including the turn's end marker (e.g. <|im_end|>), so the draft
also learns to propose the stop; whitespace the template puts after the marker is not masked, as
the target stops before it. The spans are found by rendering the conversation prefix by prefix and
require each render to extend the previous one; a template that rewrites earlier turns is an error.
Prompt and reply are tokenized apart, as an engine serving the model sees them (docs/data.md).
"""
from __future__ import annotations

import base64
import importlib
import json
import re
from itertools import accumulate, chain
from pathlib import Path

import numpy as np

from eagle3.errors import Eagle3Error, InputError

EXTRA = "pip install eagle3-trainer[chat]"

# Kimi-K2's split pattern (tokenization_kimi.py): Han runs are pre-tokens of their own.
KIMI_PATTERN = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
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
        raise InputError(f"{needed_by}: chat lines need the optional package '{module}': {EXTRA}") from None


# ---------------------------------------------------------------- conversations

def _text(content: object, where: str) -> str:
    if isinstance(content, list):
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                   for p in content):
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


# ---------------------------------------------------------------- tokenizers

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
    needed = (f"{config_path}: 'added_tokens_decoder' ({{id: {{\"content\": ...}}}}) is needed with "
              f"{model.name}")
    decoder = config.get("added_tokens_decoder")
    if not isinstance(decoder, dict) or not decoder:
        raise InputError(needed)
    try:
        return {entry["content"]: int(i) for i, entry in decoder.items()}
    except (KeyError, TypeError, ValueError):
        raise InputError(needed) from None


class TiktokenTokenizer:
    """Kimi's tokenizer: BPE ranks, Kimi's split pattern, special tokens from added_tokens_decoder."""

    def __init__(self, model: Path, config_path: Path, config: dict):
        tiktoken = _require("tiktoken", model)
        self._enc = tiktoken.Encoding(name=model.name, pat_str=KIMI_PATTERN,
                                      mergeable_ranks=_read_ranks(model),
                                      special_tokens=_special_tokens(model, config_path, config))

    def encode(self, text: str) -> list[int]:
        pieces = chain.from_iterable(_cut(chunk, KIMI_MAX_RUN, r"\s+|\S+")
                                     for chunk in _cut(text, KIMI_MAX_TEXT, r"(?s).+"))
        # every special token allowed and no BOS added: the template writes what the model sees
        return [t for piece in pieces for t in self._enc.encode(piece, allowed_special="all")]


class HFTokenizer:
    def __init__(self, path: Path):
        tokenizers = _require("tokenizers", path)
        try:
            self._tok = tokenizers.Tokenizer.from_file(str(path))
        except Exception as e:  # the Rust library raises a bare Exception for a file it cannot read
            raise InputError(f"{path}: not a tokenizers file: {e}") from None

    def encode(self, text: str) -> list[int]:
        # no post-processor BOS: the template already writes {{ bos_token }} where the model has one
        return self._tok.encode(text, add_special_tokens=False).ids


def _load_tokenizer(root: Path, config_path: Path, config: dict):
    if (root / "tiktoken.model").exists():
        return TiktokenTokenizer(root / "tiktoken.model", config_path, config)
    if (root / "tokenizer.json").exists():
        return HFTokenizer(root / "tokenizer.json")
    raise InputError(f"{root}: chat lines need the target's tokenizer: expected tiktoken.model + "
                     "tokenizer_config.json (Kimi) or tokenizer.json in the target directory")


# ---------------------------------------------------------------- template

def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # Hugging Face's variant: jinja2's own tojson HTML-escapes, which would change the prompt text
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise ChatError(f"chat template: {message}")


def _template_source(root: Path, config_path: Path, config: dict) -> tuple[str, Path]:
    path = root / "chat_template.jinja"
    if path.exists():
        return path.read_text(), path
    source = config.get("chat_template")
    if isinstance(source, list):  # named templates: [{"name": "default", "template": ...}, ...]
        source = next((t.get("template") for t in source if t.get("name") == "default"), None)
    if not isinstance(source, str):
        raise InputError(f"{root}: chat lines need the target's chat template: expected chat_template.jinja "
                         f"or 'chat_template' in {config_path.name}")
    return source, config_path


def _load_template(root: Path, config_path: Path, config: dict):
    source, origin = _template_source(root, config_path, config)
    jinja2 = _require("jinja2", origin)
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    # as transformers renders chat templates; no strftime_now, so dates fall back to the template's
    # fixed default and a resumed extraction tokenizes exactly as before
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise InputError(f"{origin}:{e.lineno}: chat template syntax error: {e.message}") from None


def _token_text(value: object) -> str:
    return value.get("content", "") if isinstance(value, dict) else value or ""


# ---------------------------------------------------------------- stop tokens

def _json_object(path: Path) -> dict:
    if not path.exists():
        return {}
    try:
        value = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InputError(f"{path}: not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise InputError(f"{path}: expected a JSON object")
    return value


def _ids(value: object, where: str) -> set[int]:
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise InputError(f"{where}: eos_token_id = {value!r}; expected an integer or a list of integers")
    return set(values)


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
    """The tokens an engine stops at, found as vLLM finds them: the tokenizer's eos token, and
    generation_config.json's eos_token_id (int or list), which falls back to config.json's
    (`config_eos`) when the model has no generation_config.json."""
    root = Path(root)
    generation = root / "generation_config.json"
    eos = _json_object(generation).get("eos_token_id") if generation.exists() else config_eos
    stop = _ids(eos, str(generation if generation.exists() else root / "config.json")) if eos is not None else set()
    token = None
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        token = token or _token_text(_json_object(root / name).get("eos_token")) or None
    if token and (i := _token_id(root, token)) is not None:
        stop.add(i)
    return stop


# ---------------------------------------------------------------- encoder

class ChatEncoder:
    """Encodes chat lines for one target directory; loading problems raise InputError."""

    def __init__(self, target_dir: str | Path):
        root = Path(target_dir)
        config_path = root / "tokenizer_config.json"
        config = _json_object(config_path)
        self.tokenizer = _load_tokenizer(root, config_path, config)
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
        """int32 ids of a chat line as a prompt to reply to (real decoding): a trailing assistant
        turn, the reference answer, is dropped and the template's generation prompt appended."""
        messages = conversation(obj, require_reply=False)
        if messages[-1]["role"] == "assistant":
            messages = messages[:-1]
        if not messages:
            raise ChatError("only an assistant turn: no prompt to reply to")
        text = self._apply(messages, add_generation_prompt=True)
        return np.asarray(self.tokenizer.encode(text), dtype=np.int32)

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
            rewrites = f"the chat template renders messages 1..{k} differently once message {k + 1} follows"
            _check_extends(before, text, rewrites)
            if message["role"] == "assistant":
                prompt = self._apply(messages[:k], add_generation_prompt=True)
                _check_extends(before, prompt, "the chat template's generation prompt changes earlier turns")
                _check_extends(prompt, text, f"message {k + 1} (assistant) does not start with the chat "
                                             "template's generation prompt")
                spans.append((len(prompt), max(len(prompt), len(text.rstrip()))))
            before = text
        return before, spans

    def _token_cuts(self, text: str, bounds: list[int]) -> tuple[list[int], list[int]]:
        """Token ids of `text` and, for each character position in `bounds`, the tokens before it.
        Where the whole text tokenizes across a boundary (a reply starting with "\n\n" after the
        template's "\n"), the pieces are tokenized apart, as an engine serving the model sees them:
        the rendered prompt is tokenized, the reply's tokens are what the model emits after it."""
        ids = self.tokenizer.encode(text)
        edges = [0, *bounds, len(text)]
        pieces = [self.tokenizer.encode(text[a:b]) for a, b in zip(edges, edges[1:])]
        joined = list(chain.from_iterable(pieces))
        if joined != ids and (cuts := self._prefix_cuts(text, bounds, ids)) is not None:
            return ids, cuts
        return joined, list(accumulate(len(p) for p in pieces[:-1]))

    def _prefix_cuts(self, text: str, bounds: list[int], ids: list[int]) -> list[int] | None:
        """Some tokenizers encode a piece alone differently (a SentencePiece-style prefix space):
        the token count of each prefix instead, if every prefix tokenizes as the start of the whole
        (None where a boundary falls inside a token)."""
        cuts = []
        for b in bounds:
            head = self.tokenizer.encode(text[:b])
            if head != ids[:len(head)]:
                return None
            cuts.append(len(head))
        return cuts


def _check_extends(prefix: str, text: str, problem: str) -> None:
    if not text.startswith(prefix):
        raise ChatError(f"{problem}, so the assistant tokens cannot be located by rendering prefixes")
