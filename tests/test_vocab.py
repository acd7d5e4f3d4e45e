from collections import Counter

import pytest
import torch

from eagle3.vocab import VocabError, build_vocab, check_vocab


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
