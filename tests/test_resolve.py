"""One resolve step: every "auto" turned into a value once, checked before extraction, carried by
checkpoints and read back by resume and export."""
import dataclasses
import json

import pytest

from conftest import make_config
from eagle3 import train_state
from eagle3 import extraction, training
from eagle3.config import ConfigError
from eagle3.export import export_all
from eagle3.models.weights import Checkpoint
from eagle3.resolve import resolve


def test_auto_takes_the_targets_values_and_the_record_is_frozen(tmp_path, llama_target, token_data):
    cfg = make_config(tmp_path, llama_target, token_data, **{"vocab.draft_vocab_size": "auto",
                                                             "extract.output_dir": tmp_path / "shards"})
    r = resolve(cfg, Checkpoint(llama_target))
    spec = r.draft_spec
    assert (spec.hidden_size, spec.num_attention_heads, spec.num_key_value_heads, spec.head_dim) == (32, 4, 2, 8)
    assert spec.draft_vocab_size == spec.target_vocab_size == 256          # min(32000, target vocab)
    assert r.aux_layer_ids == [1, 1, 1] and r.data_dir == str(tmp_path / "shards")
    assert r.verifier_name == str(llama_target)
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.data_dir = "elsewhere"
    spelled = make_config(tmp_path, llama_target, token_data, **{"extract.output_dir": f"{tmp_path}/./shards/"})
    assert resolve(spelled, Checkpoint(llama_target)).data_dir == r.data_dir   # one directory, one record


def test_a_draft_that_cannot_be_built_fails_before_extraction(tmp_path, llama_target, token_data):
    cfg = make_config(tmp_path, llama_target, token_data, **{"draft.num_attention_heads": 3})
    with pytest.raises(ConfigError, match="draft.num_attention_heads 3 is not a multiple of draft.num_key_value_heads 2"):
        extraction.run(cfg)
    assert not (tmp_path / "hidden").exists()


def test_checkpoints_carry_the_record(tmp_path, llama_target, token_data,
                                                                        hidden):
    cfg = make_config(tmp_path, llama_target, token_data, **{"extract.output_dir": hidden, "train.max_steps": 3,
                                                             "export.verifier_name": "org/target"})
    training.run(cfg)
    ckpt = train_state.latest(cfg.train.output_dir)
    state = train_state.read_state(ckpt)
    assert state["resolved"] == resolve(cfg, Checkpoint(llama_target)).to_dict()
    new = export_all(ckpt, tmp_path / "new")

    assert all((path / "config.json").exists() for path in new.values())

    with pytest.raises(training.TrainError, match="draft_spec differs"):   # resume refuses another draft shape
        training.Trainer(make_config(tmp_path, llama_target, token_data, **{
            "extract.output_dir": hidden, "train.max_steps": 6, "draft.intermediate_size": 48}))
