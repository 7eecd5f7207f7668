"""Draft vocabulary: top-N selection, d2t/t2d semantics, round trips, save/load, refusal on mismatch."""

from __future__ import annotations

import pytest
import torch

from outrider.errors import UserError
from outrider.train.data.vocab import (
    FILENAME,
    DraftVocab,
    build_draft_vocab,
    check_same,
    token_counts,
)

V = 30


def _data():
    # token 20 x4, 3 x3, 11 x3 (tie with 3), 7 x2, 25 x1; masked-out tokens must not count
    rows = [([20, 20, 3, 11, 7, 29, 29, 29], [1, 1, 1, 1, 1, 0, 0, 0]),
            ([3, 3, 11, 11, 20, 20, 7, 25], [1, 1, 1, 1, 1, 1, 1, 1])]
    return [(torch.tensor(i), torch.tensor(m)) for i, m in rows]


def test_counts_only_at_loss_masked_positions():
    counts = token_counts(_data(), V)
    assert counts[20] == 4 and counts[3] == 3 and counts[11] == 3 and counts[7] == 2 and counts[25] == 1
    assert counts[29] == 0 and int(counts.sum()) == 13
    assert torch.equal(token_counts(counts, V), counts)


def test_top_n_ties_by_id_and_offsets():
    vocab = build_draft_vocab(_data(), V, 3)
    assert vocab.draft_ids.tolist() == [3, 11, 20]  # 20 (4), then the 3/11 tie: both fit
    vocab = build_draft_vocab(_data(), V, 2)
    assert vocab.draft_ids.tolist() == [3, 20]  # tie 3 vs 11 broken by the smaller id
    vocab = build_draft_vocab(_data(), V, 5)
    assert vocab.draft_ids.tolist() == [3, 7, 11, 20, 25]
    assert vocab.d2t.dtype == torch.long and vocab.d2t.tolist() == [3, 6, 9, 17, 21]
    assert torch.equal(torch.arange(5) + vocab.d2t, vocab.draft_ids)  # target_id = i + d2t[i]
    assert vocab.t2d.dtype == torch.bool and vocab.t2d.nonzero().flatten().tolist() == [3, 7, 11, 20, 25]
    assert vocab.counts.tolist() == [3, 2, 3, 4, 1] and vocab.total == 13


def test_fill_with_unseen_ids_in_id_order():
    vocab = build_draft_vocab(_data(), V, 8)  # only 5 distinct tokens were seen
    assert vocab.draft_ids.tolist() == [0, 1, 2, 3, 7, 11, 20, 25]
    assert vocab.coverage() == 1.0


def test_default_size_and_full_vocab():
    vocab = build_draft_vocab(_data(), V)
    assert vocab.draft_vocab_size == V  # min(32000, V)
    assert torch.equal(vocab.d2t, torch.zeros(V, dtype=torch.long)) and bool(vocab.t2d.all())


def test_round_trip_target_draft_target():
    vocab = build_draft_vocab(_data(), V, 5)
    draft = vocab.to_draft(torch.arange(V))
    inside = draft >= 0
    assert inside.tolist() == vocab.t2d.tolist()
    assert torch.equal(vocab.to_target(draft[inside]), torch.arange(V)[inside])
    ids = torch.arange(5).reshape(1, 5)
    assert torch.equal(vocab.to_draft(vocab.to_target(ids)), ids)


def test_save_load_and_check_same(tmp_path):
    vocab = build_draft_vocab(_data(), V, 5)
    vocab.save(tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == [FILENAME]  # no temporary left behind
    loaded = DraftVocab.load(tmp_path)
    assert torch.equal(loaded.d2t, vocab.d2t) and torch.equal(loaded.t2d, vocab.t2d)
    assert torch.equal(loaded.counts, vocab.counts) and loaded.total == vocab.total
    assert loaded.fingerprint() == vocab.fingerprint()
    check_same(loaded, vocab)
    check_same(loaded, DraftVocab.from_mapping(vocab.d2t, vocab.t2d))  # e.g. from a head's buffers

    other_data = _data() + [(torch.tensor([28, 28, 28, 28, 28]), torch.ones(5))]
    for other in (build_draft_vocab(other_data, V, 5), build_draft_vocab(_data(), V, 6),
                  build_draft_vocab(_data(), V + 1, 5)):
        with pytest.raises(UserError, match="^draft vocabulary differs from the checkpoint's: ") as e:
            check_same(loaded, other)
        assert "\n" not in str(e.value)


def test_bad_input_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="no loss-masked tokens"):
        build_draft_vocab([(torch.tensor([1, 2]), torch.tensor([0, 0]))], V)
    with pytest.raises(UserError, match="outside the target vocabulary"):
        build_draft_vocab([(torch.tensor([1, V]), torch.tensor([1, 1]))], V)
    with pytest.raises(UserError):
        build_draft_vocab(_data(), V, V + 1)
    with pytest.raises(UserError, match="no draft vocabulary"):
        DraftVocab.load(tmp_path)
    (tmp_path / FILENAME).write_bytes(b"not safetensors")
    with pytest.raises(UserError, match="cannot read"):
        DraftVocab.load(tmp_path)
    with pytest.raises(UserError, match="disagree"):
        DraftVocab.from_mapping(torch.tensor([0, 0, 5]), torch.zeros(V, dtype=torch.bool))
