"""Chat lines: the target's tokenizer + chat template -> ids and an assistant loss mask."""
import base64
import json
import shutil
import sys

import pytest

from conftest import make_config
from eagle3 import extraction
from eagle3.data.chat import ChatEncoder
from eagle3.data.tokenizer import KIMI_PATTERN, _cut, stop_token_ids
from eagle3.data.inputs import InputError, read_records
from eagle3.data.shards import loss_token_counts, read_manifest

# A miniature Kimi tokenizer: 256 byte ranks, merges building "hello", then the special block with
# Kimi's offsets from the first special id (<|im_end|> = base + 2, ...).
MERGES = [b"he", b"ll", b"hell", b"hello"]
BASE = 256 + len(MERGES)
HELLO = BASE - 1
BOS, EOS, END, USER, ASST, SYS, MID = BASE, BASE + 1, BASE + 2, BASE + 3, BASE + 4, BASE + 10, BASE + 17
SPECIAL = {BOS: "[BOS]", EOS: "[EOS]", END: "<|im_end|>", USER: "<|im_user|>", ASST: "<|im_assistant|>",
           SYS: "<|im_system|>", MID: "<|im_middle|>"}

# Kimi-K2's template structure: a default system turn, no separators between turns.
KIMI_TEMPLATE = """\
{%- for message in messages -%}
{%- if loop.first and message['role'] != 'system' -%}
<|im_system|>system<|im_middle|>You are a bot.<|im_end|>
{%- endif -%}
{%- if message['role'] == 'system' -%}
<|im_system|>system<|im_middle|>
{%- elif message['role'] == 'user' -%}
<|im_user|>user<|im_middle|>
{%- elif message['role'] == 'assistant' -%}
<|im_assistant|>assistant<|im_middle|>
{%- else -%}
{{ raise_exception('unsupported role ' ~ message['role']) }}
{%- endif -%}
{{ message['content'] }}<|im_end|>
{%- endfor -%}
{%- if add_generation_prompt -%}
<|im_assistant|>assistant<|im_middle|>
{%- endif -%}
"""


def b(text: str) -> list[int]:
    return list(text.encode())


def make_kimi_tokenizer(root, template=KIMI_TEMPLATE, extra=()):
    """`extra`: merges ranked after the special block."""
    root.mkdir(parents=True, exist_ok=True)
    ranks = dict(enumerate([bytes([i]) for i in range(256)] + MERGES))
    ranks.update({MID + 1 + k: t for k, t in enumerate(extra)})
    (root / "tiktoken.model").write_text(
        "".join(f"{base64.b64encode(t).decode()} {r}\n" for r, t in ranks.items()))
    config = {"added_tokens_decoder": {str(i): {"content": c, "special": True} for i, c in SPECIAL.items()},
              "bos_token": "[BOS]", "eos_token": "[EOS]"}
    (root / "tokenizer_config.json").write_text(json.dumps(config))
    (root / "chat_template.jinja").write_text(template)
    return root


@pytest.fixture(scope="module")
def kimi(tmp_path_factory):
    return make_kimi_tokenizer(tmp_path_factory.mktemp("kimi"))


DIALOG = [("user", "hi"), ("assistant", "hello"), ("user", "ok?"), ("assistant", "hello hello")]
SHAREGPT = {"user": "human", "assistant": "gpt", "system": "system"}
# expected ids as (tokens, masked)
EXPECTED = [
    ([SYS, *b("system"), MID, *b("You are a bot."), END], 0),
    ([USER, *b("user"), MID, *b("hi"), END], 0),
    ([ASST, *b("assistant"), MID], 0), ([HELLO, END], 1),
    ([USER, *b("user"), MID, *b("ok?"), END], 0),
    ([ASST, *b("assistant"), MID], 0), ([HELLO, 32, HELLO, END], 1),
]


def write_lines(path, lines):
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


@pytest.mark.parametrize("form", ["messages", "sharegpt", "parts"])
def test_kimi_chat_ids_and_assistant_mask(tmp_path, kimi, form):
    if form == "sharegpt":
        line = {"conversations": [{"from": SHAREGPT[r], "value": c} for r, c in DIALOG]}
    elif form == "parts":  # content as text parts
        line = {"messages": [{"role": r, "content": [{"type": "text", "text": c}]} for r, c in DIALOG]}
    else:
        line = {"messages": [{"role": r, "content": c} for r, c in DIALOG]}
    records, stats = read_records(write_lines(tmp_path / "chat.jsonl", [line]), 1000, 4096,
                                  target_dir=kimi)
    assert records[0].input_ids.tolist() == [t for ids, _ in EXPECTED for t in ids]
    assert records[0].loss_mask.tolist() == [m for ids, m in EXPECTED for _ in ids]
    assert records[0].input_ids.dtype.name == "int32" and records[0].loss_mask.dtype.name == "uint8"
    assert stats.sequences == 1 and stats.skipped == 0


def test_text_parts_are_joined_by_newlines_as_vllm_gives_a_template_a_string(kimi):
    parts = [{"type": "text", "text": "hello"}, {"type": "text", "text": "hello"}]
    (ids, mask), = ChatEncoder(kimi).encode({"messages": [{"role": "user", "content": "hi"},
                                                          {"role": "assistant", "content": parts}]}).sequences
    assert ids[mask == 1].tolist() == [HELLO, 10, HELLO, END]


def test_system_turn_and_kimi_split_pattern(kimi):
    (ids, mask), = ChatEncoder(kimi).encode({"messages": [
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "中文English"},
        {"role": "assistant", "content": "hello"}]}).sequences
    assert ids.tolist() == [SYS, *b("system"), MID, *b("be brief"), END, USER, *b("user"), MID,
                            *b("中文English"), END, ASST, *b("assistant"), MID, HELLO, END]
    assert ids[mask == 1].tolist() == [HELLO, END]
    assert KIMI_PATTERN.startswith(r"[\p{Han}]+|")  # Han runs first, as tokenization_kimi.py


MALFORMED = [
    ("{oops", "Expecting property name"),
    ({"messages": [{"role": "bot", "content": "x"}, {"role": "assistant", "content": "y"}]},
     r"message 1 of 2: unknown role 'bot'"),
    ({"conversations": [{"from": "human", "value": "x"}]}, "no assistant turn"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": " "}]},
     "message 2 of 2: empty content"),
    ({"messages": [{"role": "tool", "content": "x"}, {"role": "assistant", "content": "y"}]},
     "chat template: unsupported role tool"),
    ({"messages": "hello"}, "'messages' must be a non-empty list"),
    ({"messages": [{"role": "assistant", "content": [{"type": "image"}]}]}, "content parts must be"),
    ({"messages": [{"role": "user", "content": 5}, {"role": "assistant", "content": "y"}]},
     "message 1 of 2: content must be a string"),
    ({"text": "hello"}, "expected an object with 'input_ids' and 'loss_mask'"),
]
GOOD = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}


@pytest.mark.parametrize("bad,reason", MALFORMED)
def test_malformed_chat_line_is_fatal_with_its_line_number(tmp_path, kimi, bad, reason):
    data = write_lines(tmp_path / "chat.jsonl", [GOOD, GOOD, bad, GOOD])
    with pytest.raises(InputError, match=rf"chat.jsonl:3: .*{reason}.*data.on_error"):
        read_records(data, 1000, 4096, "fatal", target_dir=kimi)


def test_malformed_chat_lines_skipped_and_counted(tmp_path, kimi, capsys):
    pretokenized = {"input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]}
    lines = [GOOD] + [bad for bad, _ in MALFORMED] + [pretokenized, ""]
    records, stats = read_records(write_lines(tmp_path / "chat.jsonl", lines), 1000, 4096, "skip",
                                  target_dir=kimi)
    bad_lines = list(range(2, 2 + len(MALFORMED)))
    assert stats.skipped == len(MALFORMED) and stats.skipped_lines == bad_lines
    assert stats.lines == len(MALFORMED) + 2 and stats.sequences == 2
    assert [r.line for r in records] == [1, len(MALFORMED) + 2]
    warnings = capsys.readouterr().err
    for number, (_, reason) in zip(bad_lines, MALFORMED):
        assert f"chat.jsonl:{number}: " in warnings
        assert reason.replace("\\", "") in warnings


def test_a_reply_that_does_not_follow_the_generation_prompt_is_reported(tmp_path):
    template = "{% for m in messages %}{{ m['content'] }}{% if loop.last %}<|im_end|>{% endif %}{% endfor %}"
    root = make_kimi_tokenizer(tmp_path / "tok", template)
    dialog = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    rewrites = r"chat.jsonl:1: message 2 of 2 \(assistant\) does not start with the chat template's generation prompt"
    with pytest.raises(InputError, match=rewrites):
        read_records(write_lines(tmp_path / "chat.jsonl", [dialog]), 1000, 4096, target_dir=root)


BROKEN_TEMPLATES = [
    ("{% for m in messages %}{% if m['role'] != 'assistant' %}{{ m['content'] }}{% endif %}{% endfor %}",
     "renders to no tokens"),
    ("{{ messages[5]['content'] }}", "chat template failed: UndefinedError"),
]


@pytest.mark.parametrize("template,reason", BROKEN_TEMPLATES)
def test_templates_that_hide_the_reply_are_reported(tmp_path, template, reason):
    root = make_kimi_tokenizer(tmp_path / "tok", template)
    dialog = {"messages": [{"role": "user", "content": "h"}, {"role": "assistant", "content": "ello"}]}
    with pytest.raises(InputError, match=rf"chat.jsonl:1: .*{reason}"):
        read_records(write_lines(tmp_path / "chat.jsonl", [dialog]), 1000, 4096, target_dir=root)


# Qwen's turn layout in Kimi's special tokens: the generation prompt ends in "\n"
NEWLINE_TEMPLATE = ("{% for m in messages %}<|im_user|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>{% endfor %}"
                    "{% if add_generation_prompt %}<|im_user|>assistant\n{% endif %}")


def test_a_reply_that_merges_with_the_prompt_is_tokenized_as_an_engine_sees_it(tmp_path):
    # "\n" + "\n\nhello": the whole text tokenizes "\n\n" + "\n" across the reply's start; served,
    # the prompt ends in its own "\n" token and the model emits "\n\n" then "hello"
    nn = MID + 1
    root = make_kimi_tokenizer(tmp_path / "tok", NEWLINE_TEMPLATE, extra=[b"\n\n"])
    dialog = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "\n\nhello"}]}
    encoder = ChatEncoder(root)
    (ids, mask), = encoder.encode(dialog).sequences
    prompt = [USER, *b("user"), 10, *b("hi"), END, USER, *b("assistant"), 10]
    assert ids.tolist() == prompt + [nn, HELLO, END] and mask.tolist() == [0] * len(prompt) + [1, 1, 1]
    assert encoder.encode_prompt(dialog).tolist() == prompt    # what the engine tokenizes
    # no marker at all between prompt "h" and reply "ello": the same rule, not a refusal
    bare = make_kimi_tokenizer(tmp_path / "bare", "{% for m in messages %}{{ m['content'] }}{% endfor %}")
    (ids, mask), = ChatEncoder(bare).encode({"messages": [{"role": "user", "content": "h"},
                                                       {"role": "assistant", "content": "ello"}]}).sequences
    assert ids.tolist() == [*b("h"), *b("e"), 256 + 1, *b("o")] and mask.tolist() == [0, 1, 1, 1]


def _files(root, **files):
    root.mkdir(parents=True, exist_ok=True)
    for name, value in files.items():
        (root / f"{name}.json").write_text(json.dumps(value))
    return root


def test_stop_tokens_are_found_as_the_engines_find_them(tmp_path):
    special = {"added_tokens_decoder": {"9": {"content": "<|im_end|>"}, "4": {"content": "<|endoftext|>"}}}
    # generation_config.json's list wins over config.json's eos; the tokenizer's eos is added
    root = _files(tmp_path / "a", generation_config={"eos_token_id": [5, 7]},
                  tokenizer_config={**special, "eos_token": "<|im_end|>"})
    assert stop_token_ids(root, 2) == {5, 7, 9}
    # no generation_config.json: config.json's eos_token_id; <|im_end|> is not a stop unless named
    root = _files(tmp_path / "b", tokenizer_config={**special, "eos_token": {"content": "<|endoftext|>"}})
    assert stop_token_ids(root, 2) == {2, 4}
    # transformers 5 writes no added_tokens_decoder: the eos token's id is in tokenizer.json
    root = _files(tmp_path / "c", tokenizer_config={"eos_token": "<|im_end|>"}, generation_config={"eos_token_id": 2},
                  tokenizer={"added_tokens": [{"id": 11, "content": "<|im_end|>"}], "model": {"vocab": {}}})
    assert stop_token_ids(root, None) == {2, 11}
    root = _files(tmp_path / "d", generation_config={"eos_token_id": "two"})
    with pytest.raises(InputError, match=r"d/generation_config.json: eos_token_id = 'two'; expected an integer"):
        stop_token_ids(root, None)


def test_generate_stops_where_the_engine_would(tmp_path, llama_target):
    from eagle3 import generate
    from eagle3.models.weights import Checkpoint
    target = tmp_path / "target"
    shutil.copytree(llama_target, target)
    _files(target, generation_config={"eos_token_id": [2, 3]})
    cfg = make_config(tmp_path, target, tmp_path / "none.jsonl")
    assert generate.stop_tokens(cfg, Checkpoint(target)) == {2, 3}


def test_template_syntax_error_names_the_template_file(tmp_path):
    root = make_kimi_tokenizer(tmp_path / "tok", "line one\n{% for m in messages %}")
    syntax = r"chat.jsonl:1: .*chat_template.jinja:2: chat template syntax error"
    with pytest.raises(InputError, match=syntax):
        read_records(write_lines(tmp_path / "chat.jsonl", [GOOD]), 1000, 4096, "skip", target_dir=root)


def test_tojson_keeps_non_ascii_text(tmp_path):
    template = "{% for m in messages %}{{ m['content'] | tojson }}<|im_end|>{% endfor %}"
    root = make_kimi_tokenizer(tmp_path / "tok", template)
    (ids, mask), = ChatEncoder(root).encode({"messages": [{"role": "user", "content": "<é>"},
                                                       {"role": "assistant", "content": "hello"}]}).sequences
    assert ids.tolist() == [*b('"<é>"'), END, *b('"'), HELLO, *b('"'), END]
    assert ids[mask == 1].tolist() == [*b('"'), HELLO, *b('"'), END]


def test_kimi_long_run_cuts_match_tokenization_kimi():
    # tokenization_kimi.py cuts runs of whitespace / non-whitespace longer than its limit
    assert _cut("aaaa  bbbbb", 2, r"\s+|\S+") == ["aa", "aa  bb", "bb", "b"]
    assert _cut("", 2, r"\s+|\S+") == [""]


def test_ids_outside_the_target_vocab_are_reported(tmp_path, kimi):
    with pytest.raises(InputError, match=r"chat.jsonl:1: token id \d+ >= the target's vocab_size 256"):
        read_records(write_lines(tmp_path / "chat.jsonl", [GOOD]), 256, 4096, target_dir=kimi)


def test_setup_problems_are_fatal_even_when_skipping(tmp_path, kimi, monkeypatch):
    data = write_lines(tmp_path / "chat.jsonl", [GOOD])
    with pytest.raises(InputError, match=r"chat.jsonl:1: .*no target directory"):
        read_records(data, 1000, 4096, "skip")
    with pytest.raises(InputError, match=r"chat.jsonl:1: .*expected tiktoken.model"):
        read_records(data, 1000, 4096, "skip", target_dir=tmp_path)
    no_template = make_kimi_tokenizer(tmp_path / "no_template")
    (no_template / "chat_template.jinja").unlink()
    with pytest.raises(InputError, match=r"expected chat_template.jinja or 'chat_template' in tokenizer_c"):
        read_records(data, 1000, 4096, "skip", target_dir=no_template)
    (no_template / "tokenizer_config.json").write_text("{}")
    with pytest.raises(InputError, match=r"tokenizer_config.json: 'added_tokens_decoder' .* is needed"):
        read_records(data, 1000, 4096, "skip", target_dir=no_template)
    monkeypatch.setitem(sys.modules, "tiktoken", None)  # as if the extra were not installed
    with pytest.raises(InputError, match=r"optional package 'tiktoken': pip install eagle3-trainer\[chat\]"):
        read_records(data, 1000, 4096, "skip", target_dir=kimi)


def test_pretokenized_lines_need_no_extras(tmp_path, monkeypatch):
    for module in ("tiktoken", "tokenizers", "jinja2"):
        monkeypatch.setitem(sys.modules, module, None)
    both = {"input_ids": [4, 5], "loss_mask": [0, 1], **GOOD}  # ids given with the conversation win
    data = write_lines(tmp_path / "tok.jsonl", [{"input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]}, both])
    records, stats = read_records(data, 10, 4096, target_dir=tmp_path)
    assert [r.input_ids.tolist() for r in records] == [[1, 2, 3], [4, 5]] and stats.sequences == 2


# ---------------------------------------------------------------- tokenizer.json targets

QWEN_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
WORDS = ["[UNK]", "user", "assistant", "system", "\n", " ", "hi", "hello", "there", "ok", "?"]


def make_hf_tokenizer(root, pre_tokenizer, words, template, special, named=False):
    from tokenizers import Tokenizer, models
    root.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizer
    tok.add_special_tokens(special)
    tok.save(str(root / "tokenizer.json"))
    if named:  # the list of named templates some models ship instead of one string
        template = [{"name": "tool_use", "template": "unused"}, {"name": "default", "template": template}]
    (root / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    return root, tok


def qwen_tokenizer(root):
    from tokenizers import Regex, pre_tokenizers
    split = pre_tokenizers.Split(Regex(r"\s|\w+|[^\w\s]"), behavior="isolated")
    return make_hf_tokenizer(root, split, WORDS, QWEN_TEMPLATE, ["<|im_start|>", "<|im_end|>"])


def test_tokenizer_json_target(tmp_path):
    root, tok = qwen_tokenizer(tmp_path / "qwen")
    dialog = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"},
                           {"role": "user", "content": "ok?"}, {"role": "assistant", "content": "hi"}]}
    (ids, mask), = ChatEncoder(root).encode(dialog).sequences
    text = ("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nhello there<|im_end|>\n"
            "<|im_start|>user\nok?<|im_end|>\n<|im_start|>assistant\nhi<|im_end|>")
    assert ids.tolist() == tok.encode(text, add_special_tokens=False).ids
    tokens = [tok.id_to_token(i) for i in ids]
    masked = [t for t, m in zip(tokens, mask) if m]
    # the reply and its end marker; the sequence ends there, before the newline the template writes after it
    assert masked == ["hello", " ", "there", "<|im_end|>", "hi", "<|im_end|>"]
    assert tokens[-1] == "<|im_end|>" and mask[-1] == 1


def test_sentencepiece_style_prefix_space_falls_back_to_prefix_counts(tmp_path):
    from tokenizers import pre_tokenizers
    # Metaspace "first" gives a piece encoded alone a leading ▁ it does not get inside the text
    template = ("{% for m in messages %}{% if m['role'] == 'user' %}<s>[INST]{{ m['content'] }}[/INST]"
                "{% else %}{{ m['content'] }}</s>{% endif %}{% endfor %}")
    words = ["[UNK]", "hi", "▁hi", "hello", "▁hello"]
    root, tok = make_hf_tokenizer(tmp_path / "sp", pre_tokenizers.Metaspace(prepend_scheme="first"), words,
                                  template, ["<s>", "</s>", "[INST]", "[/INST]"], named=True)
    (ids, mask), = ChatEncoder(root).encode({"conversations": [{"from": "human", "value": "hi"},
                                                            {"from": "gpt", "value": "hello"}]}).sequences
    assert [tok.id_to_token(i) for i in ids] == ["<s>", "[INST]", "hi", "[/INST]", "hello", "</s>"]
    assert mask.tolist() == [0, 0, 0, 0, 1, 1]


def test_extraction_reads_chat_data_with_the_targets_tokenizer(tmp_path, llama_target):
    target = tmp_path / "target"
    shutil.copytree(llama_target, target)
    _, tok = qwen_tokenizer(target)
    dialogs = [[("user", "hi"), ("assistant", "hello there")], [("user", "ok?"), ("assistant", "hi")]] * 3
    data = write_lines(tmp_path / "chat.jsonl",
                       [{"messages": [{"role": r, "content": c} for r, c in d]} for d in dialogs] + ["{bad"])
    out = extraction.run(make_config(tmp_path, target, data, **{"data.on_error": "skip"}))
    manifest = read_manifest(out)
    assert manifest["source"]["sequences"] == 6 and manifest["source"]["skipped_line_numbers"] == [7]
    end, hi, hello, space, there = (tok.token_to_id(t) for t in ["<|im_end|>", "hi", "hello", " ", "there"])
    assert dict(loss_token_counts(manifest)) == {hello: 3, space: 3, there: 3, hi: 3, end: 6}
