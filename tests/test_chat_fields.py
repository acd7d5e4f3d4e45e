"""Chat lines as a thinking, tool-calling model is served: every field the engines pass reaches the template, and
each assistant reply is trained as the model emitted it, in the context rendered before it. Contexts are compared
with transformers' own rendering (what vLLM and SGLang call), replies with the text the model writes."""
import datetime
import json
from pathlib import Path

import numpy as np
import pytest

from conftest import make_config
from eagle3 import extraction
from eagle3.data.chat import ChatEncoder
from eagle3.data.inputs import InputError, read_records
from eagle3.data.shards import read_manifest
from eagle3.data.tokenizer import TEMPLATE_DAY, stop_token_ids
from eagle3.models import tiny

transformers_chat = pytest.importorskip("transformers.utils.chat_template_utils")

QWEN3_TEMPLATE = (Path(__file__).parent / "fixtures" / "qwen3" / "chat_template.jinja").read_text()
KIMI_SYSTEM = "<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
CALL = {"id": "functions.get_weather:0", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}

# the four line shapes: reasoning beside content, tool calls with a tool turn and tools, multi-turn thinking,
# thinking inline in content (plus vLLM's newer name for the reasoning field)
LINES = {
    "reasoning": {"messages": [{"role": "user", "content": "2+2?"},
                               {"role": "assistant", "reasoning_content": "add them", "content": "It is 4."}]},
    "tools": {"tools": TOOLS, "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "reasoning_content": "call the tool", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "functions.get_weather:0", "name": "get_weather", "content": "sunny"},
        {"role": "assistant", "reasoning_content": "report it", "content": "It is sunny."}]},
    "multi_turn": {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
                                {"role": "assistant", "reasoning_content": "greet", "content": "hello"},
                                {"role": "user", "content": "again"},
                                {"role": "assistant", "reasoning_content": "greet twice", "content": "hello hello"}]},
    "inline": {"messages": [{"role": "user", "content": "hi"},
                            {"role": "assistant", "content": "<think>greet</think>hello"}]},
    # what a server without a reasoning parser returns after a generation prompt that opened <think>
    "inline_open": {"messages": [{"role": "user", "content": "hi"},
                                 {"role": "assistant", "content": "greet</think>hello"}]},
    "reasoning_name": {"messages": [{"role": "user", "content": "2+2?"},
                                    {"role": "assistant", "reasoning": "add them", "content": "It is 4."}]},
}
SECTION = ("<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
           '{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>')
QWEN_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
# gpt-oss (harmony): after the generation prompt `<|start|>assistant`, the analysis channel, then the final one or a
# call on the commentary channel with the arguments as emitted
GPT_OSS_CALL = ' to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>'


def harmony(reasoning: str, final: str | None = None) -> str:
    end = "<|start|>assistant" + (f"<|channel|>final<|message|>{final}<|return|>" if final is not None else GPT_OSS_CALL)
    return f"<|channel|>analysis<|message|>{reasoning}<|end|>{end}"
# what the model emits after the generation prompt, per line and target: [(reply, sequence index)]
REPLIES = {
    "kimi": {"reasoning": [("add them</think>It is 4.<|im_end|>", 0)],
             "tools": [(f"call the tool</think>{SECTION}<|im_end|>", 0), ("report it</think>It is sunny.<|im_end|>", 0)],
             "multi_turn": [("greet</think>hello<|im_end|>", 0), ("greet twice</think>hello hello<|im_end|>", 1)],
             "inline": [("greet</think>hello<|im_end|>", 0)],
             "inline_open": [("greet</think>hello<|im_end|>", 0)],
             "reasoning_name": [("add them</think>It is 4.<|im_end|>", 0)]},
    "qwen3": {"reasoning": [("<think>\nadd them\n</think>\n\nIt is 4.<|im_end|>", 0)],
              "tools": [(f"<think>\ncall the tool\n</think>\n\n{QWEN_CALL}<|im_end|>", 0),
                        ("<think>\nreport it\n</think>\n\nIt is sunny.<|im_end|>", 0)],
              "multi_turn": [("<think>\ngreet\n</think>\n\nhello<|im_end|>", 0),
                             ("<think>\ngreet twice\n</think>\n\nhello hello<|im_end|>", 1)],
              "inline": [("<think>\ngreet\n</think>\n\nhello<|im_end|>", 0)],
              "inline_open": [("<think>\ngreet\n</think>\n\nhello<|im_end|>", 0)],
              "reasoning_name": [("<think>\nadd them\n</think>\n\nIt is 4.<|im_end|>", 0)]},
    # the history drops a final reply's analysis (a second sequence) and keeps a tool call's (one sequence)
    "gpt_oss": {"reasoning": [(harmony("add them", "It is 4."), 0)],
                "tools": [(harmony("call the tool"), 0), (harmony("report it", "It is sunny."), 0)],
                "multi_turn": [(harmony("greet", "hello"), 0), (harmony("greet twice", "hello hello"), 1)],
                "inline": [(harmony("greet", "hello"), 0)],
                "inline_open": [(harmony("greet", "hello"), 0)],
                "reasoning_name": [(harmony("add them", "It is 4."), 0)]},
}
GPT_OSS_TEMPLATE = (Path(__file__).parent / "fixtures" / "gpt-oss" / "chat_template.jinja").read_text()
# gpt-oss's special tokens (o200k_harmony ids) and its generation_config.json's eos_token_id
HARMONY = {"<|endoftext|>": 199999, "<|return|>": 200002, "<|constrain|>": 200003, "<|channel|>": 200005,
           "<|start|>": 200006, "<|end|>": 200007, "<|message|>": 200008, "<|call|>": 200012}


def make_qwen3(root):
    """A byte-level BPE tokenizer (no merges) with Qwen3's special and added tokens, and its chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    root.mkdir(parents=True, exist_ok=True)
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    tok.add_tokens(["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"])
    tok.save(str(root / "tokenizer.json"))
    (root / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "chat_template": QWEN3_TEMPLATE}))
    return root


def make_gpt_oss(root):
    """A byte-level BPE tokenizer with gpt-oss's special tokens at their ids, its chat template and stop tokens."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    root.mkdir(parents=True, exist_ok=True)
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab |= {f"<|reserved_{i}|>": i for i in range(len(vocab), min(HARMONY.values()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    for name, i in sorted(HARMONY.items(), key=lambda kv: kv[1]):   # ids in gaps: reserved fillers before each
        tok.add_special_tokens([f"<|reserved_{j}|>" for j in range(tok.get_vocab_size(), i)] + [AddedToken(
            name, special=True)])
    assert {name: tok.token_to_id(name) for name in HARMONY} == HARMONY
    tok.save(str(root / "tokenizer.json"))
    (root / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|return|>", "pad_token": "<|endoftext|>"}))
    (root / "chat_template.jinja").write_text(GPT_OSS_TEMPLATE)
    (root / "generation_config.json").write_text(json.dumps({"eos_token_id": [200002, 199999, 200012]}))
    return root


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    """name -> (tokenizer directory, template text)."""
    kimi = tiny.write_kimi_chat(tmp_path_factory.mktemp("kimi"), 516, (b"he", b"ll", b"hell", b"hello"))
    return {"kimi": (kimi, tiny.kimi_chat_template()), "qwen3": (make_qwen3(tmp_path_factory.mktemp("qwen3")),
                                                                  QWEN3_TEMPLATE),
            "gpt_oss": (make_gpt_oss(tmp_path_factory.mktemp("gpt_oss")), GPT_OSS_TEMPLATE)}


def engine_messages(line: dict) -> list[dict]:
    """The messages as an engine hands them to the template: tool-call arguments parsed, reasoning under both names,
    inline thinking split off (what the model's reply parser does), null content as ""."""
    out = []
    for m in line["messages"]:
        m = dict(m, content=m.get("content") or "")
        if m["role"] == "assistant" and "</think>" in m["content"]:
            reasoning, _, m["content"] = m["content"].removeprefix("<think>").partition("</think>")
            m["reasoning_content"] = reasoning
        if (r := m.get("reasoning_content", m.get("reasoning"))) is not None:
            m.update(reasoning_content=r, reasoning=r, thinking=r)
        if "tool_calls" in m:
            m["tool_calls"] = [dict(c, function=dict(c["function"], arguments=json.loads(c["function"]["arguments"])))
                               for c in m["tool_calls"]]
        out.append(m)
    return out


def reference_prompt(template: str, line: dict, k: int, **kwargs) -> str:
    """transformers' rendering, its strftime_now (today) read as ours (the fixed TEMPLATE_DAY)."""
    [text], _ = transformers_chat.render_jinja_template([engine_messages(line)[:k]], tools=line.get("tools"),
                                                        chat_template=template, add_generation_prompt=True, **kwargs)
    return text.replace(f"Current date: {datetime.date.today():%Y-%m-%d}", f"Current date: {TEMPLATE_DAY:%Y-%m-%d}")


def replies_of(sequences):
    """(sequence index, start, end) of each run of loss_mask = 1, in order."""
    out = []
    for s, (_, mask) in enumerate(sequences):
        edges = np.flatnonzero(np.diff(np.r_[0, mask, 0]))
        out += [(s, a, b) for a, b in zip(edges[0::2], edges[1::2])]
    return out


@pytest.mark.parametrize("name", ["kimi", "qwen3", "gpt_oss"])
@pytest.mark.parametrize("shape", list(LINES))
def test_every_reply_is_trained_as_emitted_after_its_own_generation_context(targets, name, shape):
    root, template = targets[name]
    encoder = ChatEncoder(root)
    decode, encode = encoder.tokenizer.encode.decode, encoder.tokenizer.encode
    line = LINES[shape]
    encoded = encoder.encode(line)
    turns = [k for k, m in enumerate(line["messages"]) if m["role"] == "assistant"]
    spans, expected = replies_of(encoded.sequences), REPLIES[name][shape]
    assert len(spans) == len(turns) == len(expected) == encoded.replies
    assert len(encoded.sequences) == 1 + max(s for _, s in expected)
    for k, (s, start, end), (reply, seq) in zip(turns, spans, expected):
        ids, mask = encoded.sequences[s]
        assert s == seq
        context = reference_prompt(template, line, k)
        assert decode(ids[:start].tolist()) == context      # the engine's prompt for this turn, all of it
        assert decode(ids[start:end].tolist()) == reply      # then what the model wrote, through its end marker
        assert ids[start:end].tolist() == encode(reply)      # tokenized as emitted: apart from the prompt
    assert all(m[-1] == 1 for _, m in encoded.sequences)     # nothing after the last reply
    assert not encoded.unrendered - {"tool_call_id", "name"}
    # the trained tokens by category: every reasoning and tool-call token, the rest content
    reasoning = sum(len(encode(m.get("reasoning_content") or m.get("reasoning") or "")) for m in engine_messages(line))
    tools = {"kimi": SECTION, "qwen3": QWEN_CALL, "gpt_oss": GPT_OSS_CALL}[name] if shape == "tools" else ""
    assert encoded.trained["reasoning"] == reasoning
    assert encoded.trained["tool_calls"] == len(encode(tools))
    assert sum(encoded.trained.values()) == sum(int(m.sum()) for _, m in encoded.sequences)


def test_kimi_history_and_cost(targets):
    """Kimi collapses the thinking of turns before the last non-tool-call reply: a second user turn starts a
    sequence of its own, whose shared context is counted; an agentic tool loop stays one sequence."""
    encoder = ChatEncoder(targets["kimi"][0])
    multi = encoder.encode(LINES["multi_turn"])
    first, second = (ids.tolist() for ids, _ in multi.sequences)
    shared = next(i for i, (a, b) in enumerate(zip(first, second)) if a != b)
    assert multi.repeated == shared > 0
    assert "<think></think>hello<|im_end|>" in encoder.tokenizer.encode.decode(second)    # turn 1, collapsed
    assert encoder.encode(LINES["tools"]).repeated == 0


def test_regenerated_replies_get_a_sequence_each_where_their_reasoning_would_be_rewritten(targets):
    """Without reasoning in the data, Kimi renders both turns of a two-user-turn line as one sequence; regenerated
    replies carry reasoning, which the second turn's context collapses, so `regenerating` splits them."""
    line = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
                         {"role": "user", "content": "again"}, {"role": "assistant", "content": "hello hello"}]}
    kimi, qwen = ChatEncoder(targets["kimi"][0]), ChatEncoder(targets["qwen3"][0])
    assert len(kimi.encode(line).sequences) == 1 and len(kimi.encode(line, regenerating=True).sequences) == 2
    assert len(kimi.encode(LINES["tools"], regenerating=True).sequences) == 1    # the tool loop keeps reasoning
    # a template without reasoning (ChatML) renders history unchanged: one sequence either way
    plain = make_qwen3(targets["qwen3"][0].parent / "chatml")
    chatml = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
              "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    (plain / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "chat_template": chatml}))
    assert len(ChatEncoder(plain).encode(line, regenerating=True).sequences) == 1
    assert len(qwen.encode(line, regenerating=True).sequences) == 2


def test_template_kwargs_from_the_config_and_the_line(targets):
    """thinking = false (Kimi's instant mode): the generation prompt closes the thinking, the reasoning of the data
    is not trained and is reported; a line's own kwargs win over the config's."""
    root, template = targets["kimi"]
    off = ChatEncoder(root, {"thinking": False})
    encoded = off.encode(LINES["reasoning"])
    (ids, mask), = encoded.sequences
    decode = off.tokenizer.encode.decode
    assert decode(ids[mask == 0].tolist()) == reference_prompt(template, LINES["reasoning"], 1, thinking=False)
    assert decode(ids[mask == 1].tolist()) == "It is 4.<|im_end|>"
    assert encoded.unrendered == {"reasoning"}
    on = dict(LINES["reasoning"], chat_template_kwargs={"thinking": True})
    assert decode(off.encode(on).sequences[0][0][-10:].tolist()).endswith("</think>It is 4.<|im_end|>")
    assert off.encode_prompt(LINES["reasoning"]).tolist() == off.tokenizer.encode(
        reference_prompt(template, LINES["reasoning"], 1, thinking=False))
    assert ChatEncoder(root).encode_prompt(LINES["tools"]).tolist() == off.tokenizer.encode(
        reference_prompt(template, LINES["tools"], 3))


def write_lines(path, lines):
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def test_fields_the_template_does_not_render_are_reported_once_with_their_count(tmp_path, targets, capsys):
    """A ChatML template renders no reasoning, tool calls or tools: every line still trains its content, and each
    field is one warning line naming how many lines carry it and the first; keys no engine reads, likewise."""
    root = make_qwen3(tmp_path / "chatml")
    chatml = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
              "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    (root / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "chat_template": chatml}))
    weighted = {"messages": [dict(m, weight=1) for m in LINES["reasoning"]["messages"]]}
    data = write_lines(tmp_path / "chat.jsonl", [LINES["inline"], LINES["reasoning"], LINES["tools"], weighted])
    records, stats = read_records(data, 600, 4096, target_dir=root)
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning")]
    assert sorted(warnings) == sorted([
        f"warning: {data}: 4 chat lines carry reasoning that the chat template does not render (first: {data}:1): "
        "not in the training text",
        *[f"warning: {data}: 1 chat line carries {field} that the chat template does not render (first: {data}:3): "
          "not in the training text" for field in ("tool_calls", "tools", "tool_call_id", "name")],
        f"warning: {data}: 1 chat line carries 'messages[].weight', which neither vLLM nor SGLang passes to the "
        f"template (first: {data}:4): ignored"])
    assert stats.chat.trained["content"] == sum(int(r.loss_mask.sum()) for r in records)
    assert stats.chat.summary()["fields_not_rendered"] == {"reasoning": 4, "tool_calls": 1, "tools": 1,
                                                           "tool_call_id": 1, "name": 1}


BAD = [
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": None,
                                                       "tool_calls": [dict(CALL, function={"name": "f", "arguments": "{oops"})]}]},
     r"message 2 of 2: tool_calls\[0\].function.arguments is not valid JSON"),
    ({"messages": [{"role": "user", "content": "x"},
                   {"role": "assistant", "content": "y", "reasoning": "a", "reasoning_content": "b"}]},
     "message 2 of 2: reasoning_content and reasoning differ"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}],
      "chat_template_kwargs": {"add_generation_prompt": True}}, "chat_template_kwargs may not set add_generation_prompt"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": None}]},
     "message 2 of 2: empty content"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": [CALL]}, {"role": "assistant", "content": "y"}]},
     "message 1 of 2: tool_calls on a user turn"),
    ({"tools": {"name": "f"}, "messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]},
     "tools must be a list of objects"),
]


@pytest.mark.parametrize("line,reason", BAD)
def test_a_field_that_cannot_be_used_names_the_line_and_the_field(tmp_path, targets, line, reason):
    data = write_lines(tmp_path / "chat.jsonl", [LINES["reasoning"], line])
    with pytest.raises(InputError, match=rf"chat.jsonl:2: {reason}"):
        read_records(data, 600, 4096, target_dir=targets["kimi"][0])


def test_extraction_counts_what_it_trained_by_category(tmp_path, capsys):
    """The tiny Kimi-K2.5 target with its chat files: the manifest and the printed line give the trained tokens by
    category and the cost of the lines split into several sequences."""
    target = tiny.make_kimi(tmp_path / "target", layers=4, vocab=512, shards=1)
    tiny.write_kimi_chat(target, 512)
    data = write_lines(tmp_path / "chat.jsonl", list(LINES.values()))
    out = extraction.run(make_config(tmp_path, target, data))
    chat = read_manifest(out)["source"]["chat"]
    encoder = ChatEncoder(target)
    encoded = [encoder.encode(line) for line in LINES.values()]
    trained = {k: sum(e.trained[k] for e in encoded) for k in ("reasoning", "content", "tool_calls")}
    assert chat["trained_tokens"] == trained and all(trained.values())
    assert chat["lines"] == len(LINES) and chat["replies"] == len(LINES) + 2 and chat["split_lines"] == 1
    assert chat["sequences"] == len(LINES) + 1 and chat["repeated_tokens"] == encoded[2].repeated > 0
    assert read_manifest(out)["source"]["sequences"] == chat["sequences"]
    printed = capsys.readouterr().out
    assert (f"trained tokens: reasoning {trained['reasoning']:,}, content {trained['content']:,}, tool calls "
            f"{trained['tool_calls']:,};") in printed


def test_the_thinking_demo_trains_reasoning_and_tool_calls_beside_the_plain_demo(tmp_path, capsys):
    """`python -m eagle3 demo --thinking`: the tiny target gets Kimi-K2.5's tokenizer files and template, its data
    is chat lines with reasoning (one trace long) and tool calls, and its runs sit beside the plain demo's;
    extraction says what it trained by category, so a regression in what is trained shows as a number; the last
    lines put real decoding beside the estimate and say why they differ (the text is not the target's own)."""
    from eagle3.__main__ import main
    config = tmp_path / "config.toml"
    config.write_text(f"""[target]\npath = "{tmp_path / 'target'}"\n[data]\npath = "{tmp_path / 'data.jsonl'}"
[extract]\noutput_dir = "{tmp_path / 'hidden'}"\n[train]\noutput_dir = "{tmp_path / 'train'}"
max_steps = 2\neval_every = 2\neval_fraction = 0.25\n[evaluate]\nmax_new_tokens = 16\n""")
    tiny.make_chat_data(tmp_path / "thinking.jsonl", conversations=12)   # the demo's own data, smaller
    main(["demo", "--thinking", "--config", str(config), "--debug.train_device", "cpu", "--debug.extract_device", "cpu",
          "--debug.evaluate_device", "cpu"])
    out = capsys.readouterr().out
    assert "Kimi-K2.5's tokenizer files and chat template" in out
    assert (tmp_path / "target-thinking" / "tiktoken.model").exists() and not (tmp_path / "target").exists()
    chat = read_manifest(tmp_path / "hidden-thinking")["source"]["chat"]
    assert chat["lines"] == 12 and chat["split_lines"] == 3 and all(chat["trained_tokens"].values())
    trained = chat["trained_tokens"]
    assert (f"reasoning {trained['reasoning']:,}, content {trained['content']:,}, tool calls {trained['tool_calls']:,}"
            in out)
    assert (tmp_path / "train-thinking" / "export" / "vllm").is_dir() and not (tmp_path / "train").exists()
    assert (tmp_path / "thinking-prompts.jsonl").exists() and not (tmp_path / "prompts.jsonl").exists()
    assert trained["reasoning"] > 1_350    # line 7's long trace alone has ~1,350 reasoning tokens
    report = json.loads(next((tmp_path / "train-thinking" / "checkpoints").glob("*/eval.json")).read_text())
    assert f"demo: real decoding {report['real_accept_len']:.2f} tokens per target forward" in out
    assert "they differ because the replies trained and held out are the data's text as written" in out


def test_a_reply_is_trained_with_its_tool_arguments_as_emitted_and_without_its_name(targets):
    """The model wrote the arguments' text: its own turn trains that text (the history gets the parsed object, as the
    engines pass it); a `name` on the turn is the engine's business, not in the generation prompt's header."""
    encoder = ChatEncoder(targets["kimi"][0])
    raw = '{"city":"Paris","n":1.50}'
    call = dict(CALL, function={"name": "get_weather", "arguments": raw})
    line = {"messages": [{"role": "user", "content": "Weather?"},
                         {"role": "assistant", "name": "kimi", "reasoning_content": "call", "content": "",
                          "tool_calls": [call]},
                         {"role": "tool", "tool_call_id": CALL["id"], "content": "sunny"},
                         {"role": "assistant", "reasoning_content": "report", "content": "Sunny."}]}
    encoded = encoder.encode(line)
    decode = encoder.tokenizer.encode.decode
    (s, a, b), _ = replies_of(encoded.sequences)
    ids = encoded.sequences[s][0]
    assert decode(ids[:a].tolist()).endswith("<|im_assistant|>assistant<|im_middle|><think>")
    assert decode(ids[a:b].tolist()) == "call</think>" + SECTION.replace('{"city": "Paris"}', raw) + "<|im_end|>"
    # the history shows the name as its role and the parsed arguments: a context of its own for the next reply
    assert len(encoded.sequences) == 2 and '<|im_assistant|>kimi<|im_middle|>' in decode(encoded.sequences[1][0].tolist())
    assert encoded.trained["tool_calls"] == len(encoder.tokenizer.encode(SECTION.replace('{"city": "Paris"}', raw)))


def test_a_truncated_split_line_keeps_only_parts_with_something_to_train(tmp_path, targets, capsys):
    """Each later part of a split line carries the whole context before its reply: cut at data.max_seq_len, a part
    left with no reply token is not extracted, and the counts are of what is left."""
    turns = [{"role": "system", "content": "Be brief."}]
    for i in range(4):
        turns += [{"role": "user", "content": f"question {i} " * 4},
                  {"role": "assistant", "reasoning_content": "think " * 12, "content": "answer " * 6}]
    data = write_lines(tmp_path / "chat.jsonl", [{"messages": turns}])
    full, _ = read_records(data, 600, 100_000, target_dir=targets["kimi"][0])
    lengths = [len(r.input_ids) for r in full]
    assert len(full) == 4 and lengths == sorted(lengths)
    cut = lengths[1] + 10     # parts 3 and 4 lose their replies
    records, stats = read_records(data, 600, cut, target_dir=targets["kimi"][0])
    assert [r.part for r in records] == [0, 1, 2] and all(r.loss_mask.any() for r in records[:2])
    assert stats.truncated == 1 and stats.chat.dropped_parts == 1 and stats.chat.sequences == 3
    assert (stats.chat.replies, stats.chat.replies_trained, stats.chat.replies_cut) == (4, 3, 1)
    assert sum(stats.chat.trained.values()) == sum(int(r.loss_mask.sum()) for r in records)
    assert "1 sequences of chat lines split by their template kept nothing to train" in capsys.readouterr().err


def test_replies_without_reasoning_under_a_thinking_prompt_are_counted(tmp_path, targets, capsys):
    line = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    data = write_lines(tmp_path / "chat.jsonl", [line, line, LINES["reasoning"]])
    _, stats = read_records(data, 600, 4096, target_dir=targets["kimi"][0])
    assert stats.chat.empty_thoughts == 2
    assert "2 replies have no reasoning where the chat template opens one" in capsys.readouterr().err
    _, stats = read_records(data, 600, 4096, target_dir=targets["kimi"][0], template_kwargs={"thinking": False})
    assert stats.chat.empty_thoughts == 0


def test_chat_lines_rendered_by_a_pool_of_processes_are_the_same(tmp_path, targets, monkeypatch):
    from eagle3.data import inputs
    data = write_lines(tmp_path / "chat.jsonl", [*LINES.values(), "{bad", LINES["tools"]] * 3)
    serial = read_records(data, 600, 4096, "skip", target_dir=targets["kimi"][0])
    monkeypatch.setattr(inputs, "POOL_BYTES", 0)
    pooled = read_records(data, 600, 4096, "skip", target_dir=targets["kimi"][0], workers=2)
    assert [(r.line, r.part, r.input_ids.tolist(), r.loss_mask.tolist()) for r in serial[0]] == \
        [(r.line, r.part, r.input_ids.tolist(), r.loss_mask.tolist()) for r in pooled[0]]
    assert serial[1] == pooled[1] and serial[1].skipped_lines == [len(LINES) + 1, 2 * len(LINES) + 3, 3 * len(LINES) + 5]
    with pytest.raises(InputError, match=r"chat.jsonl:1: .*no target directory"):
        read_records(data, 600, 4096, "skip", workers=2)


def test_gpt_oss_tool_arguments_and_stop_tokens_as_the_model_emits_them(targets):
    """A call's arguments are trained as emitted (the template's `arguments|tojson` would quote the string), and
    generate stops a reply at <|return|> (the final channel) or <|call|> (a tool call), never at <|end|>."""
    root, _ = targets["gpt_oss"]
    encoder = ChatEncoder(root)
    compact = dict(CALL, function=dict(CALL["function"], arguments='{"city":"Paris"}'))
    line = {"tools": TOOLS, "messages": [{"role": "user", "content": "Weather in Paris?"},
                                         {"role": "assistant", "reasoning": "call the tool", "tool_calls": [compact]}]}
    (ids, mask), = encoder.encode(line).sequences
    assert encoder.tokenizer.encode.decode(ids[mask == 1].tolist()).endswith(
        '<|channel|>commentary json<|message|>{"city":"Paris"}<|call|>')
    assert stop_token_ids(root, None) == {HARMONY["<|return|>"], HARMONY["<|endoftext|>"], HARMONY["<|call|>"]}
