import pytest

from eagle3.config import ConfigError, load


def write(tmp_path, text):
    path = tmp_path / "c.toml"
    path.write_text(text)
    return path


def test_defaults_and_overrides(tmp_path):
    path = write(tmp_path, '[train]\nlr = 2e-4\nmax_steps = 5\n[extract]\noutput_dir = "x"\n')
    cfg = load(path, ["--train.seed", "7", "--train.betas=[0.8, 0.9]", "--draft.hidden_size", "auto",
                      "--export.formats", '["vllm"]'])
    assert cfg.train.lr == 2e-4 and cfg.train.max_steps == 5 and cfg.train.seed == 7
    assert cfg.train.betas == [0.8, 0.9] and cfg.draft.hidden_size is None
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
    with pytest.raises(ConfigError, match=r"command line --train.ttt_steps: train.ttt_steps: expected int"):
        load(None, ["--train.ttt_steps", "1.5"])
    with pytest.raises(ConfigError, match=r"train.kernels = 'cuda'; expected one of"):
        load(None, ["--train.kernels", "cuda"])
    with pytest.raises(ConfigError, match=r"train.batch_tokens = 0; expected a positive integer"):
        load(None, ["--train.batch_tokens", "0"])
    with pytest.raises(ConfigError, match=r"train.grad_clip = 0.0; expected > 0"):
        load(None, ["--train.grad_clip", "0"])
    with pytest.raises(ConfigError, match=r"train.min_lr_ratio = 2.0; expected a number in \[0, 1\]"):
        load(None, ["--train.min_lr_ratio", "2"])
    with pytest.raises(ConfigError, match=r"aux_layer_ids = \[1, 2\]; EAGLE-3 needs exactly 3"):
        load(None, ["--target.aux_layer_ids", "[1, 2]"])


def test_bad_toml_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="not valid TOML"):
        load(write(tmp_path, "[train\n"))
    with pytest.raises(ConfigError, match="config file not found"):
        load(tmp_path / "nope.toml")
    with pytest.raises(ConfigError, match="needs a value"):
        load(None, ["--train.lr"])


def test_repo_config_toml_is_valid():
    from pathlib import Path
    cfg = load(Path(__file__).resolve().parents[1] / "config.toml")
    assert cfg.train.resume == "auto" and cfg.train.ttt_steps == 7
