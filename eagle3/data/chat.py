"""Chat lines -> the sequences the engine generated each assistant reply in. Every field the engines' chat API
carries (reasoning, tool calls, tool results, tools, template kwargs) reaches the target's own template as vLLM and
SGLang pass it; each reply is trained as the model emitted it, after the context rendered before it (docs/data.md)."""
from __future__ import annotations

import dataclasses
import functools
import json
import os
from dataclasses import dataclass, field
from itertools import accumulate, chain
from pathlib import Path

import numpy as np

from eagle3.config import RESERVED_KWARGS
from eagle3.data.media import Media, MediaReader, content_parts, expand, has_media, with_videos
from eagle3.data.tokenizer import ChatError, EmittedJSON, TargetTokenizer

ROLES = {"messages": ("role", "content", {"system": "system", "user": "user", "assistant": "assistant", "tool": "tool"}),
         "conversations": ("from", "value", {"system": "system", "human": "user", "gpt": "assistant"})}
# what vLLM (>= 0.11.1) and SGLang pass to the template per message, besides role and content
# (`thinking`: transformers' name, which gpt-oss's template reads; vLLM and SGLang serve gpt-oss through
# openai-harmony, which renders the reasoning as the analysis channel the template writes from it)
MESSAGE_FIELDS = ("reasoning_content", "reasoning", "thinking", "tool_calls", "tool_call_id", "name")
REASONING = ("reasoning_content", "reasoning", "thinking")
LINE_FIELDS = ("tools", "chat_template_kwargs")
GENERATED = ("source_line", "source_part", "cut_replies")   # what `generate` adds to a chat line it writes back
THINK_START, THINK_END = "<think>", "</think>"
CATEGORIES = ("reasoning", "content", "tool_calls")
PROBE = "\u2063probe\u2063"   # a reasoning no data holds: shows whether the template keeps a turn's reasoning
RENDERING = 4   # the version of how chat lines become sequences: an extraction planned under another is not resumed


@dataclass
class Chat:
    messages: list[dict]         # as the engines pass them to the template
    tools: list | None
    kwargs: dict                 # chat_template_kwargs: the config's default, then the line's
    ignored: set[str]            # keys of the line no engine reads, e.g. "messages[].weight"
    emitted: dict = field(default_factory=dict)   # message index -> its tool calls with arguments as emitted
    media: list = field(default_factory=list)     # (message index, kind, url) of each media part in order
    videos: list[str] = field(default_factory=list)   # each video's prompt text, for the template's placeholder


@dataclass
class Encoded:
    """A chat line as training sequences, (int32 ids, uint8 loss mask) each, and per sequence each token's kind: 0 for
    context, else 1 + its category's index in CATEGORIES."""
    sequences: list[tuple[np.ndarray, np.ndarray]]
    kinds: list[np.ndarray] = field(default_factory=list)
    replies: int = 0
    repeated: int = 0            # tokens a sequence shares with the line's previous one (rendered again)
    unrendered: set[str] = field(default_factory=set)    # fields of the line the template leaves out of the text
    ignored: set[str] = field(default_factory=set)
    empty_thoughts: int = 0      # replies without reasoning where the template opens one: trained as an empty thought
    missing: set[str] = field(default_factory=set)       # ids the line lacks where the template renders one
    media: list[list[tuple]] = field(default_factory=list)   # per sequence (pad start, MediaItem) of its media

    @property
    def trained(self) -> dict[str, int]:
        """Loss tokens by category."""
        return count_kinds(self.kinds)


def count_kinds(kinds: list[np.ndarray]) -> dict[str, int]:
    """Loss tokens by category, over sequences' kinds."""
    return {c: sum(int((k == i + 1).sum()) for k in kinds) for i, c in enumerate(CATEGORIES)}


@dataclass
class Reply:
    text: str                    # after the generation prompt, through the end-of-turn marker
    spans: dict                  # category -> [start, end) in text (content: everything else)
    unrendered: set[str]
    empty_thought: bool = False  # no reasoning, where the reply holds `</think>`


def _text(content: object, where: str) -> str:
    """Content as the engines give the template a string: None -> "", text parts joined by newlines (vLLM)."""
    if content is None:
        return ""
    if isinstance(content, list):
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
            raise ChatError(f"{where}: content parts must be {{\"type\": \"text\", \"text\": ...}}")
        return "\n".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise ChatError(f"{where}: content must be a string, a list of text parts or null")
    return content


def _split_think(content: str, where: str) -> tuple[str | None, str]:
    """(reasoning, content) of a reply written with its thinking inline: `<think>R</think>C`, or `R</think>C` as a
    server without a reasoning parser returns it after a generation prompt that opened `<think>`; (None, content)
    without `</think>`. A reply that opens `<think>` and never closes it is refused: a trace cut off mid-thought,
    whose reasoning the template would close and end as the model did not."""
    head, end, rest = content.partition(THINK_END)
    if not end and content.lstrip().startswith(THINK_START):
        raise ChatError(f"{where}: the reply opens {THINK_START} and never closes it with {THINK_END} (a trace cut "
                        "off mid-thought): its thought cannot be told from its reply; close it, give the thought as "
                        "reasoning_content, or leave the line out")
    if not end:
        return None, content
    return head.lstrip().removeprefix(THINK_START), rest


def _tool_calls(calls: object, where: str) -> tuple[list[dict], list[dict]]:
    """OpenAI tool calls with `arguments` parsed to an object, as both engines hand them to templates (the turn in
    history), and with `arguments` as given (the text the model emitted: its own reply is trained with it)."""
    if not isinstance(calls, list):
        raise ChatError(f"{where}: tool_calls must be a list")
    out, emitted = [], []
    for i, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ChatError(f"{where}: tool_calls[{i}] must be {{\"id\", \"type\": \"function\", \"function\": "
                            "{\"name\", \"arguments\"}}")
        arguments = function.get("arguments") or {}
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                raise ChatError(f"{where}: tool_calls[{i}].function.arguments is not valid JSON") from None
        if not isinstance(arguments, dict):
            raise ChatError(f"{where}: tool_calls[{i}].function.arguments must be a JSON object")
        out.append({**call, "type": call.get("type", "function"), "function": {**function, "arguments": arguments}})
        raw = function.get("arguments")
        emitted.append({**out[-1], "function": {**function, "arguments": EmittedJSON(raw) if raw and isinstance(
            raw, str) else arguments}})
    return out, emitted


def _message(turn: object, number: int, total: int, key: str) -> tuple[dict, set[str], list | None, list]:
    """One turn as the engines pass it to the template, the keys of it they do not read, its tool calls with
    their arguments as emitted, and (kind, url) of its media parts."""
    role_key, text_key, roles = ROLES[key]
    where = f"message {number} of {total}"
    role = turn.get(role_key) if isinstance(turn, dict) else None
    if not isinstance(role, str) or role not in roles:
        raise ChatError(f"{where}: unknown role {role!r}; expected '{role_key}' one of {sorted(roles)}")
    refs = []
    if has_media(turn.get(text_key)):
        if roles[role] == "assistant":
            raise ChatError(f"{where}: image or video parts in an assistant turn; the model writes only text")
        message = {"role": roles[role], "content": None}
        message["content"], refs = content_parts(turn[text_key], where)
    else:
        message = {"role": roles[role], "content": _text(turn.get(text_key), where)}
    given = {k: turn[k] for k in REASONING if turn.get(k) is not None}
    if len(set(map(str, given.values()))) > 1:
        raise ChatError(f"{where}: {' and '.join(given)} differ; give one")
    reasoning = next(iter(given.values()), None)
    if reasoning is None and message["role"] == "assistant":
        reasoning, message["content"] = _split_think(message["content"], where)
    if reasoning is not None:
        if message["role"] != "assistant":
            name = next(iter(given), "reasoning")
            raise ChatError(f"{where}: {name} on a {message['role']} turn; only assistant turns carry reasoning")
        if not isinstance(reasoning, str):
            raise ChatError(f"{where}: {next(iter(given))} must be a string, not {type(reasoning).__name__}")
        message.update(dict.fromkeys(REASONING, reasoning))   # vLLM passes the first two names
    emitted = None
    if turn.get("tool_calls"):   # an empty list is no tool call (vLLM drops it)
        if message["role"] != "assistant":
            raise ChatError(f"{where}: tool_calls on a {message['role']} turn")
        message["tool_calls"], emitted = _tool_calls(turn["tool_calls"], where)
    for k in ("tool_call_id", "name"):
        if turn.get(k) is not None:
            if not isinstance(turn[k], str):
                raise ChatError(f"{where}: {k} must be a string")
            message[k] = turn[k]
    if message["role"] == "assistant" and not (message["content"].strip() or reasoning or "tool_calls" in message):
        raise ChatError(f"{where}: empty content")
    if message["role"] not in ("assistant", "tool") and not (refs or message["content"].strip()):
        raise ChatError(f"{where}: empty content")
    ignored = {f"{key}[].{k}" for k in turn if k not in (role_key, text_key, *MESSAGE_FIELDS)}
    return message, ignored, emitted, refs


def conversation(obj: dict, default_kwargs: dict, require_reply: bool = True) -> Chat:
    """The line's turns, tools and template kwargs as the engines pass them (a prompt needs no reply)."""
    key = "messages" if "messages" in obj else "conversations"
    turns = obj[key]
    if not isinstance(turns, list) or not turns:
        raise ChatError(f"'{key}' must be a non-empty list of turns")
    parsed = [_message(turn, n, len(turns), key) for n, turn in enumerate(turns, start=1)]
    messages = [m for m, *_ in parsed]
    if require_reply and not any(m["role"] == "assistant" for m in messages):
        raise ChatError(f"no assistant turn in '{key}': nothing to learn from")
    tools = obj.get("tools")
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise ChatError("tools must be a list of objects")
    kwargs = obj.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise ChatError("chat_template_kwargs must be an object")
    if reserved := sorted(RESERVED_KWARGS & set(kwargs)):
        raise ChatError(f"chat_template_kwargs may not set {', '.join(reserved)}")
    ignored = set().union(*(i for _, i, _, _ in parsed)) | {k for k in obj if k not in (key, *LINE_FIELDS, *GENERATED)}
    emitted = {k: calls for k, (_, _, calls, _) in enumerate(parsed) if calls}
    media = [(k, *ref) for k, (*_, refs) in enumerate(parsed) for ref in refs]
    return Chat(messages, tools or None, {**default_kwargs, **kwargs}, ignored, emitted, media)


def _without(message: dict, keys: tuple[str, ...]) -> dict:
    return {k: v for k, v in message.items() if k not in keys}


def _diff(a: str, b: str) -> tuple[int, int]:
    """[start, end) in `a` of what `a` has beyond `b` (their common prefix and suffix taken off)."""
    start = len(os.path.commonprefix([a, b]))
    tail = len(os.path.commonprefix([a[start:][::-1], b[start:][::-1]]))
    return start, len(a) - tail


class ChatEncoder:
    """Encodes chat lines for one target directory; loading problems raise InputError."""

    def __init__(self, target_dir: str | Path, template_kwargs: dict | None = None):
        self.tokenizer = TargetTokenizer(target_dir)
        self.target_dir = Path(target_dir)
        self.default_kwargs = dict(template_kwargs or {})   # checked by the config (RESERVED_KWARGS)

    @functools.cached_property
    def media_reader(self) -> MediaReader:
        return MediaReader(self.target_dir)   # read at the first line with media: text-only targets need no config

    def _media(self, chat: Chat, base: Path | None) -> tuple[Chat, Media | None]:
        """The line's media decoded (`base`: the data file's directory), and the chat with its videos' prompts."""
        if not chat.media:
            return chat, None
        media = self.media_reader.read(chat.media, Path(base or "."))
        return dataclasses.replace(chat, videos=media.videos), media

    def _expand(self, ids: np.ndarray, arrays: list[np.ndarray], media: Media,
                context: np.ndarray | None = None) -> tuple:
        """`ids` and the per-token `arrays` with each pad of the `context` (not a reply) expanded to its media's
        tokens; (start, item) per item."""
        counts, starts = expand(ids, media.items, self.media_reader.pad_id, context)
        return np.repeat(ids, counts), [np.repeat(a, counts) for a in arrays], list(zip(starts, media.items))

    def encode(self, obj: dict, regenerating: bool = False, base: Path | None = None) -> Encoded:
        """The sequences of a {"messages"} or {"conversations"} line: replies share one sequence while the template
        renders the earlier ones unchanged before the next; `regenerating`: also while it would keep their reasoning.
        `base`: where the line's media paths are read from."""
        chat, media = self._media(conversation(obj, self.default_kwargs), base)
        render = self._renderer(chat)
        out = Encoded([], ignored=set(chat.ignored))
        groups: list[tuple[str, list[int], list[Reply]]] = []   # (text, reply bounds, replies)
        separator = None
        for k, message in enumerate(chat.messages):
            if message["role"] != "assistant":
                continue
            prompt = render(chat.messages[:k], True)
            if separator is None:
                separator = self._separator(chat, k)
            reply = self._reply(chat, k, prompt, separator)
            if not reply.text:
                raise ChatError(f"message {k + 1} of {len(chat.messages)} (assistant) renders to no tokens")
            out.replies += 1
            out.empty_thoughts += reply.empty_thought
            out.unrendered |= reply.unrendered
            if groups and prompt.startswith(groups[-1][0]) and (not regenerating or self._keeps_reasoning(chat, k)):
                text, bounds, replies = groups.pop()
            else:
                bounds, replies = [], []
            groups.append((prompt + reply.text, [*bounds, len(prompt), len(prompt) + len(reply.text)],
                           [*replies, reply]))
        for text, bounds, replies in groups:
            ids, cuts, starts = self._token_cuts(text, bounds)
            kinds = np.zeros(len(ids), dtype=np.uint8)
            for reply, start, end, token_starts in zip(replies, cuts[0::2], cuts[1::2], starts):
                kinds[start:end] = _kinds(reply, token_starts, end - start)
            ids, placed = np.asarray(ids, dtype=np.int32), []
            if media is not None:
                ids, (kinds,), placed = self._expand(ids, [kinds], media, kinds == 0)
            if out.sequences:
                previous = out.sequences[-1][0]
                out.repeated += len(os.path.commonprefix([previous[:len(ids)].tolist(), ids[:len(previous)].tolist()]))
            out.sequences.append((ids, (kinds > 0).astype(np.uint8)))
            out.kinds.append(kinds)
            out.media.append(placed)
        if media is not None:
            last = max(k for k, m in enumerate(chat.messages) if m["role"] == "assistant")
            self._check_all_placed(len(out.media[-1]), sum(owner < last for owner in media.owners))
        out.unrendered |= self._unrendered_context(chat, render)
        out.missing = {name for name in ID_FIELDS if any(_lacks(m, name) for m in chat.messages) and PROBE in
                       render([_probe_id(m, name) if _lacks(m, name) else m for m in chat.messages], False)}
        return out

    def encode_prompt(self, obj: dict, base: Path | None = None) -> np.ndarray:
        """int32 ids of a chat line as a prompt: a trailing assistant turn dropped, the generation prompt added."""
        return self.encode_prompt_media(obj, base)[0]

    def encode_prompt_media(self, obj: dict, base: Path | None = None) -> tuple[np.ndarray, list[tuple]]:
        """encode_prompt's ids, and (pad start, MediaItem) of each of its media."""
        chat, media = self._media(conversation(obj, self.default_kwargs, require_reply=False), base)
        messages = chat.messages[:-1] if chat.messages[-1]["role"] == "assistant" else chat.messages
        if not messages:
            raise ChatError("only an assistant turn: no prompt to reply to")
        ids = np.asarray(self.tokenizer.encode(self._renderer(chat)(messages, True)), dtype=np.int32)
        if media is None:
            return ids, []
        ids, _, placed = self._expand(ids, [], media)
        self._check_all_placed(len(placed), sum(owner < len(messages) for owner in media.owners))
        return ids, placed

    @staticmethod
    def _check_all_placed(placed: int, given: int) -> None:
        if placed != given:
            raise ChatError(f"the chat template writes {placed} <|media_pad|> placeholder(s) for {given} image(s) "
                            "or video chunk(s): placeholders and media disagree (does the template render media "
                            "parts?)")

    def _renderer(self, chat: Chat):
        def render(messages: list[dict], add_generation_prompt: bool) -> str:
            text = self.tokenizer.render(messages, add_generation_prompt, chat.tools, chat.kwargs)
            return with_videos(text, chat.videos, self.media_reader.video_placeholder) if chat.videos else text
        return render

    def _separator(self, chat: Chat, k: int) -> str:
        """The whitespace the template writes after any reply (ChatML's newline): it belongs to the next context.
        Found once per line, from a placeholder reply after the turns before turn k."""
        render = self._renderer(chat)
        prompt = render(chat.messages[:k], True)
        whole = render([*chat.messages[:k], {"role": "assistant", "content": PROBE}], False)
        text = whole[len(prompt):] if whole.startswith(prompt) else ""
        return text[len(text.rstrip()):]

    def _reply(self, chat: Chat, k: int, prompt: str, separator: str) -> Reply:
        """Turn k as the model emitted it after the generation prompt (its tool calls' arguments as given, no `name`:
        the engine's header is the generation prompt's), rendered after the earlier turns without their reasoning
        (context, never reply: templates that drop it from history then agree with the prompt; `prompt` where
        there is none). Where the template drops the turn's own reasoning (Kimi's final turns: it renders them as
        history), the reasoning goes before `</think>`, where the model wrote it."""
        render = self._renderer(chat)
        message = _without(chat.messages[k], ("name",))
        if k in chat.emitted:
            message["tool_calls"] = chat.emitted[k]
        context = [_without(m, REASONING) for m in chat.messages[:k]]
        if any(m.keys() & set(REASONING) for m in chat.messages[:k]):
            prompt = render(context, True)

        def reply(m: dict) -> str | None:
            whole = render([*context, m], False)
            return whole[len(prompt):].removesuffix(separator) if whole.startswith(prompt) else None

        bare = reply(_without(message, (*REASONING, "tool_calls")))
        if bare is None:
            raise ChatError(f"message {k + 1} of {len(chat.messages)} (assistant) does not start with the chat "
                            "template's generation prompt, so its tokens cannot be located")
        text, spans, unrendered = bare, {}, set()
        if "tool_calls" in message:
            tools = reply(_without(message, REASONING))
            if tools is None or tools == bare:
                unrendered.add("tool_calls")
            else:
                text, spans = tools, {"tool_calls": _diff(tools, bare)}
        if not (reasoning := message.get("reasoning")):
            return Reply(text, spans, unrendered, empty_thought=THINK_END in text)
        full = reply(message)
        if full is not None and full != text:
            start, end = _diff(full, text)
            return Reply(full, {**_shift(spans, start, len(full) - len(text)),
                                "reasoning": _within(full, reasoning.strip(), start, end)}, unrendered)
        if THINK_END not in text:   # thinking off, or a template without reasoning
            return Reply(text, spans, unrendered | {"reasoning"})
        at = text.index(THINK_END)
        return Reply(text[:at] + reasoning + text[at:],
                     {**_shift(spans, at, len(reasoning)), "reasoning": (at, at + len(reasoning))}, unrendered)

    def _keeps_reasoning(self, chat: Chat, k: int) -> bool:
        """Whether turn k's context renders the reasoning of the reply before it, where that reply (regenerated)
        would carry reasoning in this template's format."""
        j = max(i for i in range(k) if chat.messages[i]["role"] == "assistant")
        probed = dataclasses.replace(chat, messages=[dict(m, **dict.fromkeys(REASONING, PROBE)) if i == j else m
                                                     for i, m in enumerate(chat.messages)])
        render = self._renderer(probed)
        if "reasoning" not in self._reply(probed, j, render(probed.messages[:j], True), "").spans:
            return True
        return PROBE in render(probed.messages[:k], True)

    def _unrendered_context(self, chat: Chat, render) -> set[str]:
        """The line's tools, template kwargs, and the tool-turn fields before its last reply the template never reads."""
        out = {f"chat_template_kwargs.{k}" for k in chat.kwargs if k not in self.tokenizer.template_variables}
        if chat.tools and "tools" not in self.tokenizer.template_variables:
            out.add("tools")
        last = max(k for k, m in enumerate(chat.messages) if m["role"] == "assistant")
        context = chat.messages[:last]
        for key in ("tool_call_id", "name"):
            if any(key in m for m in context):
                if render([_without(m, (key,)) for m in context], True) == render(context, True):
                    out.add(key)
        return out

    def _token_cuts(self, text: str, bounds: list[int]) -> tuple[list[int], list[int], list[list[int]]]:
        """Token ids of `text`, per character position in `bounds` the tokens before it, and the character offsets
        (within its reply) of each reply token. The pieces between bounds are tokenized apart, as an engine sees
        prompt and reply (docs/data.md)."""
        edges = [0, *bounds, len(text)]
        encode = self.tokenizer.encode   # the odd pieces are replies: their tokens' offsets give their categories
        pieces = [encode.with_starts(text[a:b]) if i % 2 else (encode(text[a:b]), None)
                  for i, (a, b) in enumerate(zip(edges, edges[1:]))]
        joined = list(chain.from_iterable(ids for ids, _ in pieces))
        starts = [s for _, s in pieces[1::2]]
        ids = self.tokenizer.encode(text)
        if joined != ids:   # a piece alone encodes differently (a SentencePiece prefix space): cut by prefixes
            heads = [self.tokenizer.encode(text[:b]) for b in bounds]
            if all(h == ids[:len(h)] for h in heads):   # each prefix tokenizes as the start of the whole
                return ids, [len(h) for h in heads], starts
        return joined, list(accumulate(len(piece) for piece, _ in pieces[:-1])), starts


ID_FIELDS = ("tool_calls[].id", "tool_call_id")   # what ties a tool result to its call


def _lacks(message: dict, name: str) -> bool:
    if name == "tool_call_id":
        return message["role"] == "tool" and not message.get("tool_call_id")
    return any(not call.get("id") for call in message.get("tool_calls") or ())


def _probe_id(message: dict, name: str) -> dict:
    """`message` with PROBE as its missing id field `name`."""
    if name == "tool_call_id":
        return {**message, "tool_call_id": PROBE}
    return {**message, "tool_calls": [c if c.get("id") else {**c, "id": PROBE} for c in message["tool_calls"]]}


def _within(text: str, reasoning: str, start: int, end: int) -> tuple[int, int]:
    """The reasoning's own span in text[start:end], what the template added with it (gpt-oss's analysis channel
    header and end) left to content; the whole of it where the template rewrote the reasoning."""
    at = text.find(reasoning, start, end)
    return (at, at + len(reasoning)) if reasoning and at >= 0 else (start, end)


def _shift(spans: dict, at: int, by: int) -> dict:
    """`spans` with every span at or after `at` moved `by` characters (text was inserted at `at`)."""
    return {k: (a + by, b + by) if a >= at else (a, b) for k, (a, b) in spans.items()}


def _kinds(reply: Reply, starts: list[int], n: int) -> list[int]:
    """The kind of each of the `n` tokens of a reply tokenized alone from character offsets `starts` (a prefix cut
    may give the reply a token more or less than that: content)."""
    ends = [*starts[1:], len(reply.text)]
    kinds = [1 + CATEGORIES.index(_category(reply.spans, (a + b - 1) / 2)) for a, b in zip(starts, ends)]
    return (kinds + [1 + CATEGORIES.index("content")] * n)[:n]


def _category(spans: dict, middle: float) -> str:
    """The category of the token whose middle character is at `middle` (a span found by difference may be a
    character or two off at its ends)."""
    return next((k for k, (a, b) in spans.items() if a <= middle < b), "content")
