"""Mask builders and conversions: exact values, PyTorch's conventions, and dtype safety."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import attn_course as ac


@pytest.mark.parametrize("L,S", [(4, 4), (3, 6), (6, 3), (1, 1)])
def test_causal_mask_is_top_left_like_torch(L, S):
    mask = ac.causal_mask(L, S)
    assert mask.dtype == torch.bool and mask.shape == (L, S)
    for i in range(L):
        for j in range(S):
            assert mask[i, j] == (j <= i)
    # Same result as PyTorch's is_causal on an identity-like probe.
    q = torch.zeros(1, L, 1, dtype=torch.float64)
    k = torch.zeros(1, S, 1, dtype=torch.float64)
    v = torch.eye(S, dtype=torch.float64)[None]
    via_flag = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    via_mask = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    torch.testing.assert_close(via_flag, via_mask)


def test_causal_mask_device_and_default_square():
    mask = ac.causal_mask(3, device="cpu")
    assert mask.shape == (3, 3) and mask.device.type == "cpu"
    assert mask.tolist() == [[True, False, False], [True, True, False], [True, True, True]]


def test_padding_mask_values():
    mask = ac.padding_mask([3, 1, 0], max_len=4)
    assert mask.tolist() == [
        [True, True, True, False],
        [True, False, False, False],
        [False, False, False, False],
    ]
    assert ac.padding_mask(torch.tensor([2, 5])).shape == (2, 5)


def test_combine_masks_is_logical_and_with_broadcasting():
    pad = ac.padding_mask([3, 2])[:, None, None, :]  # (2, 1, 1, 3)
    causal = ac.causal_mask(3)  # (3, 3)
    both = ac.combine_masks(pad, causal, None)
    assert both.shape == (2, 1, 3, 3)
    assert both[1, 0].tolist() == [[True, False, False], [True, True, False], [True, True, False]]
    assert ac.combine_masks(None, None) is None


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_mask_to_bias_is_exact_in_every_dtype(dtype):
    mask = ac.causal_mask(4)
    bias = ac.mask_to_bias(mask, dtype)
    assert bias.dtype == dtype
    assert (bias[mask] == 0).all() and torch.isneginf(bias[~mask]).all()
    scores = torch.randn(4, 4).to(dtype) * 100
    weights = torch.softmax((scores + bias).float(), dim=-1)
    assert (weights[~mask] == 0).all() and torch.isfinite(weights).all()


def test_minus_1e9_overflows_fp16_but_bias_does_not():
    scores = torch.zeros(2, 2, dtype=torch.float16)
    mask = ac.causal_mask(2)
    with pytest.raises(RuntimeError, match="overflow"):
        scores.masked_fill(~mask, -1e9)
    assert torch.isfinite(torch.softmax(scores + ac.mask_to_bias(mask, torch.float16), -1)).all()


def test_blocked_mask_conversions_round_trip():
    mask = ac.causal_mask(3)
    blocked = ac.to_blocked_mask(mask)
    assert blocked.tolist() == [[False, True, True], [False, False, True], [False, False, False]]
    assert torch.equal(ac.from_blocked_mask(blocked), mask)
    additive = torch.zeros(3, 3)
    assert ac.from_blocked_mask(additive) is additive


def test_fully_masked_rows_bool_and_float():
    mask = torch.tensor([[True, False], [False, False]])
    assert ac.fully_masked_rows(mask).tolist() == [[False], [True]]
    bias = ac.mask_to_bias(mask)
    assert ac.fully_masked_rows(bias).tolist() == [[False], [True]]


def test_with_causal_combines_bool_float_and_none_like_is_causal():
    causal = torch.ones(3, 5, dtype=torch.bool).tril()  # top-left, written out
    assert torch.equal(ac.with_causal(None, 3, 5), causal)
    keep = torch.tensor([True, True, False, True, True])  # (S,) key mask
    assert torch.equal(ac.with_causal(keep, 3, 5), keep & causal)
    bias = torch.arange(5.0).expand(2, 3, 5)  # (B, L, S) additive
    expected = torch.where(causal, bias, torch.tensor(float("-inf")))
    assert torch.equal(ac.with_causal(bias, 3, 5), expected)
