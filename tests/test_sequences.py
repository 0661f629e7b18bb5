"""Synthetic sequence tasks: targets mean what the docstrings say; seeded; inputs validated."""

from __future__ import annotations

import pytest
import torch

from attn_course.data.sequences import PAD, decode_lookback, lookback_task, padded_batch, token_labels


def test_lookback_targets_name_the_tokens_one_and_three_steps_back():
    x, y = lookback_task(50, length=12, vocab_size=8, offsets=(1, 3), seed=3)
    assert x.shape == y.shape == (50, 12) and x.dtype == y.dtype == torch.long
    assert 0 <= int(x.min()) and int(x.max()) < 8 and int(y.max()) < 64
    pairs = decode_lookback(y, vocab_size=8, num_offsets=2)  # (N, L, 2)
    for t in range(12):
        assert torch.equal(pairs[:, t, 0], x[:, max(t - 1, 0)])
        assert torch.equal(pairs[:, t, 1], x[:, max(t - 3, 0)])
    # the code is order-aware: (a, b) and (b, a) are different classes
    assert torch.equal(y[:, 5], x[:, 4] * 8 + x[:, 2])


def test_lookback_single_offset_and_three_offsets():
    x, y = lookback_task(10, length=6, vocab_size=5, offsets=(2,))
    assert torch.equal(y[:, 2:], x[:, :-2]) and torch.equal(y[:, :2], x[:, :1].expand(-1, 2))
    x, y = lookback_task(10, length=6, vocab_size=3, offsets=(1, 2, 4))
    assert torch.equal(decode_lookback(y, vocab_size=3, num_offsets=3)[:, 5], torch.stack([x[:, 4], x[:, 3], x[:, 1]], -1))


def test_lookback_is_seeded():
    a = lookback_task(20, seed=7)
    b = lookback_task(20, seed=7)
    c = lookback_task(20, seed=8)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], c[0])


def test_lookback_rejects_bad_arguments():
    with pytest.raises(ValueError, match="num_sequences must be >= 1"):
        lookback_task(0)
    with pytest.raises(ValueError, match="offsets is empty"):
        lookback_task(3, offsets=())
    with pytest.raises(ValueError, match="each offset must be >= 1"):
        lookback_task(3, offsets=(0, 1))
    with pytest.raises(TypeError, match="length must be an int"):
        lookback_task(3, length=4.0)


def test_padded_batch_pads_with_pad_and_returns_the_mask():
    tokens, keep = padded_batch([3, 5, 1], vocab_size=6, seed=1)
    assert tokens.shape == keep.shape == (3, 5) and keep.dtype == torch.bool
    assert keep.sum(1).tolist() == [3, 5, 1]
    assert (tokens[~keep] == PAD).all() and (tokens[keep] != PAD).all()
    assert int(tokens.max()) < 6
    tokens, keep = padded_batch([2], max_len=4)
    assert keep.tolist() == [[True, True, False, False]]
    with pytest.raises(ValueError, match="exceeds max_len"):
        padded_batch([5], max_len=3)


def test_token_labels():
    assert token_labels(torch.tensor([0, 1, 25, 26])) == ["A", "B", "Z", "26"]
    assert token_labels([3, 0, 0], pad=0) == ["D", "·", "·"]
    with pytest.raises(ValueError, match="one sequence"):
        token_labels(torch.zeros(2, 3, dtype=torch.long))
