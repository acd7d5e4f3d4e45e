import re

import pytest

from conftest import ROOT
from eagle3.config import ConfigError, load, markdown_table, schema, tomllib


def write(tmp_path, text):
    path = tmp_path / "c.toml"
    path.write_text(text)
    return path


def test_defaults_and_overrides(tmp_path):
    path = write(tmp_path, '[train]\nlr = 2e-4\nmax_steps = 5\n[extract]\noutput_dir = "x"\n')
    cfg = load(path, ["--train.seed", "7", "--train.betas=[0.8, 0.9]", "--draft.head_dim", "auto",
                      "--export.formats", '["vllm"]'])
    assert cfg.train.lr == 2e-4 and cfg.train.max_steps == 5 and cfg.train.seed == 7
    assert cfg.train.betas == [0.8, 0.9] and cfg.draft.head_dim is None
    assert cfg.export.formats == ["vllm"]
    assert cfg.resolved_train_data_dir() == "x"       # train.data_dir defaults to extract.output_dir
    cfg = load(path, ["--train.data_dir", "y", "--train.lr=1"])
    assert cfg.resolved_train_data_dir() == "y" and cfg.train.lr == 1.0


def test_unknown_key_names_allowed_keys(tmp_path):
    with pytest.raises(ConfigError, match=r"c.toml: unknown key 'train.learning_rate'.*lr"):
        load(write(tmp_path, "[train]\nlearning_rate = 1\n"))
    with pytest.raises(ConfigError, match=r"unknown section \[trian\]"):
        load(write(tmp_path, "[trian]\nlr = 1\n"))


def test_wrong_type_names_key(tmp_path):
    with pytest.raises(ConfigError, match=r"train.max_steps: expected int, got 'ten'"):
        load(write(tmp_path, '[train]\nmax_steps = "ten"\n'))


@pytest.mark.parametrize("args, message", [
    (["--train.ttt_steps", "1.5"], r"command line --train.ttt_steps: train.ttt_steps: expected int"),
    (["--debug.kernels", "cuda"], r"debug.kernels = 'cuda'; expected one of"),
    (["--train.float8_head", "maybe"], r"train.float8_head: expected bool \| auto, got 'maybe'"),
    (["--train.batch_tokens", "0"], r"train.batch_tokens = 0; expected a positive integer"),
    (["--train.grad_clip", "0"], r"train.grad_clip = 0.0; expected > 0"),
    (["--train.min_lr_ratio", "2"], r"train.min_lr_ratio = 2.0; expected a number in \[0, 1\]"),
    (["--target.aux_layer_ids", "[1, 2]"], r"aux_layer_ids = \[1, 2\]; EAGLE-3 needs exactly 3"),
    (["--data.windows", "[512, 0.5]"], r"data.windows = \[512.0, 0.5\]; expected \[\] or \[share, tokens\]"),
])
def test_a_bad_override_names_the_key_and_what_was_expected(args, message):
    with pytest.raises(ConfigError, match=message):
        load(None, args)


def test_bad_toml_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="not valid TOML"):
        load(write(tmp_path, "[train\n"))
    with pytest.raises(ConfigError, match="config file not found"):
        load(tmp_path / "nope.toml")
    with pytest.raises(ConfigError, match="needs a value"):
        load(None, ["--train.lr"])


def test_a_choice_outside_the_schemas_literal_names_file_key_and_choices(tmp_path):
    with pytest.raises(ConfigError, match=r"c.toml: data.on_error = 'ignore'; expected one of \('fatal', 'skip'\)"):
        load(write(tmp_path, '[data]\non_error = "ignore"\n'))
    with pytest.raises(ConfigError, match=r"c.toml: export.formats\[1\] = 'onnx'; expected one of \('vllm', "):
        load(write(tmp_path, '[export]\nformats = ["vllm", "onnx"]\n'))
    with pytest.raises(ConfigError, match=r"command line --extract.aux_dtype: extract.aux_dtype = 'fp8'; "
                                          r"expected one of \('bfloat16', 'float8_e4m3fn'\)"):
        load(None, ["--extract.aux_dtype", "fp8"])


def test_repo_config_toml_is_valid_and_sets_every_key():
    cfg = load(ROOT / "config.toml")
    assert cfg.train.resume == "auto" and cfg.train.ttt_steps == 7
    data = tomllib.loads((ROOT / "config.toml").read_text())
    assert sorted(f"{section}.{key}" for section, values in data.items() for key in values) == \
        sorted(key.name for key in schema())


def test_every_key_has_a_doc_and_the_docs_table_is_the_schemas():
    assert all(key.doc and "\n" not in key.doc for key in schema())
    lines = (ROOT / "docs" / "config.md").read_text().split("\n")
    start = lines.index("| key | type | default | meaning |")
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith("|")), len(lines))
    expected = markdown_table(load(ROOT / "config.toml"), "config.toml")
    assert "\n".join(lines[start:end]) + "\n" == expected, \
        "docs/config.md's table is not the schema's: paste `python -m eagle3 config --config config.toml --markdown`"


def test_a_user_holds_the_config_in_their_head_and_old_keys_name_their_successor(tmp_path):
    assert len(schema(everything=False)) <= 65   # the long-context and MLA keys (draft.attention, draft.sliding_window,
    # train.context_parallel) made it 63, the engine's rule at image placeholders (draft.media_embedding) 64, the long
    # recipe's windows (data.windows) 65
    assert {key.name.split(".")[0] for key in schema()} - {key.name.split(".")[0] for key in schema(False)} == \
        {"experimental", "debug"}
    for old, new in (("train.overwrite = true", 'train.resume = "overwrite"'), ("train.kernels = \"torch\"", "debug.kernels"),
                     ("draft.fc_norm = true", 'experimental.aux_norm = "per_layer"'),
                     ("train.hard_label = 0.5", "measured without gain")):
        section, line = old.split(".", 1)
        path = write(tmp_path, f"[{section}]\n{line}\n")
        with pytest.raises(ConfigError, match=f"{path}: {old.split(' ')[0]} is gone: .*{re.escape(new)}"):
            load(path)
    with pytest.raises(ConfigError, match=r"command line --train.device: train.device is gone: now debug.train_device"):
        load(None, ["--train.device", "cpu"])


def test_a_string_in_toml_is_no_number(tmp_path):
    """TOML is typed: "200" is a string there (the command line has only text, so it parses literals)."""
    path = tmp_path / "c.toml"
    path.write_text('[train]\nmax_steps = "200"\n')
    with pytest.raises(ConfigError, match=r"c.toml: train.max_steps: expected int, got '200'"):
        load(path)
    assert load(None, ["--train.max_steps", "200"]).train.max_steps == 200
    path.write_text('[train]\nfloat8 = "true"\n')
    with pytest.raises(ConfigError, match="train.float8"):
        load(path)


@pytest.mark.parametrize("args, key", [(["--train.lr", "-1"], "train.lr"),
                                       (["--evaluate.top_p", "2"], "evaluate.top_p"),
                                       (["--train.batch_tokens=0"], "train.batch_tokens")])
def test_a_range_error_names_where_the_value_came_from(tmp_path, args, key):
    path = tmp_path / "c.toml"
    path.write_text("[train]\nlr = 1e-4\n")
    with pytest.raises(ConfigError) as e:
        load(path, args)
    assert str(e.value).startswith(f"command line --{key}: {key} = "), str(e.value)
    path.write_text(f"[{key.split('.')[0]}]\n{key.split('.')[1]} = {args[-1].split('=')[-1] if '=' in args[0] else args[1]}\n")
    with pytest.raises(ConfigError) as e:
        load(path)
    assert str(e.value).startswith(f"{path}: {key} = "), str(e.value)
