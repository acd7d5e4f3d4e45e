from collections import Counter

import pytest
import torch

from conftest import make_config
from eagle3 import training
from eagle3.data.shards import ShardReader, loss_token_counts
from eagle3.vocab import VocabError, build_vocab, check_vocab, coverage


def test_top_ids_sorted_with_invariant():
    counts = Counter({7: 10, 3: 10, 50: 5, 2: 1, 99: 7})
    d2t, t2d = build_vocab(counts, target_vocab=100, draft_vocab=3)
    assert t2d.nonzero().flatten().tolist() == [3, 7, 99]        # ties broken by lower id, then sorted
    assert (torch.arange(3) + d2t).tolist() == [3, 7, 99]
    assert d2t.dtype == torch.int64 and t2d.dtype == torch.bool and t2d.numel() == 100


def test_topped_up_with_unseen_ids():
    d2t, t2d = build_vocab(Counter({10: 3}), target_vocab=20, draft_vocab=4)
    assert t2d.nonzero().flatten().tolist() == [0, 1, 2, 10]
    check_vocab(d2t, t2d)


def test_errors():
    with pytest.raises(VocabError, match="draft_vocab_size = 200"):
        build_vocab(Counter({1: 1}), target_vocab=100, draft_vocab=200)
    d2t, t2d = build_vocab(Counter({1: 1, 5: 2}), 10, 2)
    with pytest.raises(VocabError, match="!= nonzero"):
        check_vocab(d2t + 1, t2d)


def test_coverage_is_the_share_of_counted_tokens_in_the_draft_vocab(tmp_path, llama_target, token_data, hidden,
                                                                     capsys):
    counts = Counter({7: 10, 3: 10, 50: 5, 2: 1, 99: 7})
    _, t2d = build_vocab(counts, target_vocab=100, draft_vocab=3)
    assert coverage(counts, t2d) == 27 / 33 and coverage(Counter(), t2d) == 0.0
    cfg = make_config(tmp_path, llama_target, token_data, **{"extract.output_dir": hidden, "vocab.draft_vocab_size": 5})
    trainer = training.Trainer(cfg)
    counts = loss_token_counts(ShardReader(hidden).manifest)
    share = coverage(counts, trainer.model.draft.t2d.cpu())
    assert 0 < share < 1 and f"draft vocab: 5 of 256 tokens, {share:.1%} of the loss tokens" in capsys.readouterr().err
