"""The target's tokenizer files: its encode function (Kimi's tiktoken.model or a Hugging Face tokenizer.json),
its chat template as the engines render it, and the tokens an engine stops at (docs/data.md)."""
from __future__ import annotations

import base64
import datetime
import importlib
import json
import re
from collections.abc import Callable
from pathlib import Path

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


class Encoder:
    """The target's tokenizer: Kimi's tiktoken.model or a Hugging Face tokenizer.json. Neither adds special tokens
    (no BOS): the template writes what the model sees."""

    def __init__(self, root: Path, config_path: Path, config: dict):
        if (model := root / "tiktoken.model").exists():
            self._tiktoken = _require("tiktoken", model).Encoding(
                name=model.name, pat_str=KIMI_PATTERN, mergeable_ranks=_read_ranks(model),
                special_tokens=_special_tokens(model, config_path, config))
            self._hf = None
        elif (path := root / "tokenizer.json").exists():
            tokenizers = _require("tokenizers", path)
            try:
                self._hf = tokenizers.Tokenizer.from_file(str(path))
            except Exception as e:  # the Rust library raises a bare Exception for a file it cannot read
                raise InputError(f"{path}: not a tokenizers file: {e}") from None
        else:
            raise InputError(f"{root}: chat lines need the target's tokenizer: expected tiktoken.model + "
                             "tokenizer_config.json (Kimi) or tokenizer.json in the target directory")

    def __call__(self, text: str) -> list[int]:
        if self._hf is not None:
            return self._hf.encode(text, add_special_tokens=False).ids
        return [t for _, piece in self._pieces(text) for t in self._tiktoken.encode(piece, allowed_special="all")]

    def decode(self, ids: list[int]) -> str:
        """The text of `ids`, special tokens included."""
        if self._hf is not None:
            return self._hf.decode(ids, skip_special_tokens=False)
        return self._tiktoken.decode(ids)

    def with_starts(self, text: str) -> tuple[list[int], list[int]]:
        """Token ids of `text` and the character offset where each token starts."""
        if self._hf is not None:
            encoding = self._hf.encode(text, add_special_tokens=False)
            return encoding.ids, [start for start, _ in encoding.offsets]
        ids, starts = [], []
        for offset, piece in self._pieces(text):
            piece_ids = self._tiktoken.encode(piece, allowed_special="all")
            ids += piece_ids
            starts += [offset + s for s in self._tiktoken.decode_with_offsets(piece_ids)[1]]
        return ids, starts

    @staticmethod
    def _pieces(text: str):
        """(offset, piece) of `text` cut as Kimi cuts it before tiktoken."""
        offset = 0
        for chunk in _cut(text, KIMI_MAX_TEXT, r"(?s).+"):
            for piece in _cut(chunk, KIMI_MAX_RUN, r"\s+|\S+"):
                yield offset, piece
                offset += len(piece)


class EmittedJSON(str):
    """Tool-call arguments as the model emitted them (JSON text): `tojson` writes them unchanged, where a template
    serialises the arguments object (gpt-oss's `tool_call.arguments|tojson`) and would quote a string."""


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # Hugging Face's variant: jinja2's own tojson HTML-escapes, which would change the prompt text
    if isinstance(value, EmittedJSON):
        return str(value)
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise ChatError(f"chat template: {message}")


# the day strftime_now formats: Llama 3.1's template's own date where strftime_now is undefined, so its text is as
# without it; the engines render the day they serve (a date in the system message: context, never trained)
TEMPLATE_DAY = datetime.date(2024, 7, 26)


def _load_template(root: Path, config_path: Path, config: dict):
    """(the compiled template, the names of the variables it reads from its caller)."""
    path = root / "chat_template.jinja"
    source, origin = (path.read_text(), path) if path.exists() else (config.get("chat_template"), config_path)
    if isinstance(source, list):  # named templates: [{"name": "default", "template": ...}, ...]
        source = next((t.get("template") for t in source if t.get("name") == "default"), None)
    if not isinstance(source, str):
        raise InputError(f"{root}: chat lines need the target's chat template: expected chat_template.jinja "
                         f"or 'chat_template' in {config_path.name}")
    jinja2 = _require("jinja2", origin)
    import jinja2.meta
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    # as transformers renders templates, but strftime_now (gpt-oss's system message, Llama 3.1's) formats one fixed
    # day, so that a resumed extraction tokenizes exactly as before
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = TEMPLATE_DAY.strftime
    try:
        variables = jinja2.meta.find_undeclared_variables(env.parse(source))
        return env.from_string(source), variables
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




class TargetTokenizer:
    """The target's tokenizer and chat template, read once from its directory; loading problems raise InputError."""

    def __init__(self, target_dir: str | Path):
        root = Path(target_dir)
        config_path = root / "tokenizer_config.json"
        config = _json_object(config_path)
        self.encode = Encoder(root, config_path, config)
        self.template, self.template_variables = _load_template(root, config_path, config)
        self.variables = {"bos_token": _token_text(config.get("bos_token")),
                          "eos_token": _token_text(config.get("eos_token"))}

    def render(self, messages: list[dict], add_generation_prompt: bool, tools: list | None, kwargs: dict) -> str:
        """The template's text for `messages`, called as the engines call it (docs/data.md)."""
        try:
            return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                        tools=tools, **self.variables, **kwargs)
        except ChatError:
            raise
        except Exception as e:  # a template is third-party code: whatever it raises is this line's problem
            raise ChatError(f"chat template failed: {type(e).__name__}: {e}") from None
