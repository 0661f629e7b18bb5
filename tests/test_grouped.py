"""Grouped-query / multi-query attention: equal to ordinary attention with K/V heads repeated."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import attn_course as ac
from attn_course.grouped import GroupedQueryAttention, grouped_attention, repeat_kv
from attn_course.kv_cache import compare_kv_cache_memory, kv_cache_bytes

F64 = {"atol": 1e-10, "rtol": 1e-10}


def randn(gen, *shape, dtype=torch.float64, requires_grad=False):
    return torch.randn(*shape, generator=gen, dtype=dtype).requires_grad_(requires_grad)


def make_gqa(E=16, H=4, Hkv=2, *, seed=0, **kwargs):
    torch.manual_seed(seed)
    module = GroupedQueryAttention(E, H, Hkv, dtype=torch.float64, **kwargs)
    with torch.no_grad():  # non-zero biases, so a bias mix-up cannot hide
        for p in module.parameters():
            if p.dim() == 1:
                p.normal_()
    return module


def reference_forward(module, x, mask=None, *, is_causal=False):
    """Ordinary multi-head attention after repeating each K/V head for its query group."""
    q = ac.split_heads(module.q_proj(x), module.num_heads)  # (B, H, L, D)
    k = ac.split_heads(module.k_proj(x), module.num_kv_heads)  # (B, Hkv, S, D)
    v = ac.split_heads(module.v_proj(x), module.num_kv_heads)
    n_rep = module.num_heads // module.num_kv_heads
    out, weights = ac.scaled_dot_product_attention(
        q, repeat_kv(k, n_rep), repeat_kv(v, n_rep), mask, is_causal=is_causal, need_weights=True
    )
    return module.out_proj(ac.merge_heads(out)), weights


@pytest.mark.parametrize("H,Hkv", [(4, 1), (4, 2), (4, 4), (8, 2)], ids=["MQA", "GQA-2", "MHA", "GQA-8-2"])
@pytest.mark.parametrize("is_causal", [False, True])
def test_module_equals_repeated_kv(gen, H, Hkv, is_causal):
    module = make_gqa(16, H, Hkv)
    x = randn(gen, 3, 6, 16)
    keep = ac.padding_mask([6, 4, 2])[:, None, None, :]  # (B, 1, 1, S): padding that really masks
    expected, expected_w = reference_forward(module, x, keep, is_causal=is_causal)
    out, weights = module(x, mask=keep, is_causal=is_causal, need_weights=True)
    torch.testing.assert_close(out, expected, **F64)
    torch.testing.assert_close(weights, expected_w, **F64)
    assert weights.shape == (3, H, 6, 6)
    torch.testing.assert_close(module(x, mask=keep, is_causal=is_causal), expected, **F64)  # fused path


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize(
    "mask_shape", [None, (5, 7), (2, 1, 1, 7), (2, 8, 5, 7), (8, 1, 7), (1, 8, 5, 1)],
    ids=["none", "LS", "B11S", "BHLS", "H1S", "1HL1"],
)
@pytest.mark.parametrize("is_causal", [False, True])
def test_function_equals_repeated_kv_with_gradients(gen, fused, mask_shape, is_causal):
    q, k, v = randn(gen, 2, 8, 5, 4, requires_grad=True), randn(gen, 2, 2, 7, 4, requires_grad=True), randn(
        gen, 2, 2, 7, 3, requires_grad=True
    )
    mask = None
    if mask_shape is not None:
        mask = torch.rand(*mask_shape, generator=gen) < 0.6
        mask[..., 0] = True
    got = grouped_attention(q, k, v, mask, is_causal=is_causal, fused=fused)
    expected = ac.scaled_dot_product_attention(q, repeat_kv(k, 4), repeat_kv(v, 4), mask, is_causal=is_causal)
    torch.testing.assert_close(got, expected, **F64)
    grad = randn(gen, *got.shape)
    got_grads = torch.autograd.grad(got, (q, k, v), grad)
    expected_grads = torch.autograd.grad(expected, (q, k, v), grad)
    for a, b in zip(got_grads, expected_grads):
        torch.testing.assert_close(a, b, **F64)


def test_head_order_matters(gen):
    """Query head h reads K/V head h // R (repeat_interleave), not h % Hkv (repeat): the test can tell."""
    q, k, v = randn(gen, 1, 4, 3, 4), randn(gen, 1, 2, 3, 4), randn(gen, 1, 2, 3, 4)
    got = grouped_attention(q, k, v)
    tiled = ac.scaled_dot_product_attention(q, k.repeat(1, 2, 1, 1), v.repeat(1, 2, 1, 1))
    assert not torch.allclose(got, tiled)
    assert torch.equal(repeat_kv(torch.arange(2.0).view(1, 2, 1, 1), 2).flatten(), torch.tensor([0.0, 0.0, 1.0, 1.0]))


def test_num_kv_heads_equal_num_heads_is_multihead_attention(gen):
    torch.manual_seed(0)
    mha = ac.MultiHeadAttention(16, 4, dtype=torch.float64)
    gqa = GroupedQueryAttention(16, 4, 4, dtype=torch.float64)
    gqa.load_state_dict(mha.state_dict())  # same parameter names and shapes
    x = randn(gen, 2, 5, 16)
    causal = ac.causal_mask(5)
    torch.testing.assert_close(gqa(x, mask=causal), mha(x, mask=causal), **F64)
    # and the default num_kv_heads is num_heads, so the inherited from_torch works too
    ref = nn.MultiheadAttention(16, 4, batch_first=True, dtype=torch.float64)
    converted = GroupedQueryAttention.from_torch(ref)
    assert converted.num_kv_heads == 4
    torch.testing.assert_close(converted(x), ref(x, x, x, need_weights=False)[0], **F64)


def test_parameter_shapes_and_counts():
    mqa = GroupedQueryAttention(32, 8, 1)
    gqa = GroupedQueryAttention(32, 8, 2)
    mha = ac.MultiHeadAttention(32, 8)
    assert mqa.k_proj.weight.shape == (4, 32) and mqa.v_proj.weight.shape == (4, 32)
    assert gqa.k_proj.weight.shape == (8, 32) and gqa.q_proj.weight.shape == (32, 32)
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    assert count(mqa) < count(gqa) < count(mha)
    assert count(mha) - count(gqa) == 2 * (32 * 32 + 32 - (32 * 8 + 8))
    assert "num_kv_heads=2" in repr(gqa)


def test_from_multihead_mean_pools_and_is_exact_for_equal_heads(gen):
    torch.manual_seed(0)
    mha = ac.MultiHeadAttention(16, 4, dtype=torch.float64)
    D = mha.head_dim
    with torch.no_grad():  # make heads 0 == 1 and 2 == 3 in both K and V
        for proj in (mha.k_proj, mha.v_proj):
            proj.weight.view(2, 2, D, 16)[:, 1] = proj.weight.view(2, 2, D, 16)[:, 0]
            proj.bias.view(2, 2, D)[:, 1] = proj.bias.view(2, 2, D)[:, 0]
    gqa = GroupedQueryAttention.from_multihead(mha, 2)
    x = randn(gen, 2, 5, 16)
    torch.testing.assert_close(gqa(x, is_causal=True), mha(x, is_causal=True), **F64)
    # In general the group's projection is the mean of its heads'.
    torch.manual_seed(1)
    other = ac.MultiHeadAttention(16, 4, dtype=torch.float64)
    pooled = GroupedQueryAttention.from_multihead(other, 1)
    torch.testing.assert_close(pooled.k_proj.weight, other.k_proj.weight.view(4, D, 16).mean(0), **F64)
    torch.testing.assert_close(pooled.q_proj.weight, other.q_proj.weight, **F64)
    assert not torch.allclose(pooled(x), other(x))


def test_constructor_and_input_errors(gen):
    with pytest.raises(ValueError, match=r"num_heads=8 is not divisible by num_kv_heads=3.*one of \[1, 2, 4, 8\]"):
        GroupedQueryAttention(32, 8, 3)
    with pytest.raises(ValueError, match=r"num_kv_heads must be >= 1, got 0"):
        GroupedQueryAttention(32, 8, 0)
    with pytest.raises(ValueError, match=r"d_model=30 is not divisible by num_heads=8"):
        GroupedQueryAttention(30, 8, 2)
    q, k = randn(gen, 1, 6, 3, 4), randn(gen, 1, 4, 3, 4)
    with pytest.raises(ValueError, match=r"6 query heads cannot be split evenly over 4 key/value heads"):
        grouped_attention(q, k, k)
    with pytest.raises(ValueError, match=r"k must be 4-D \(B, heads, length, D\), got shape \(4, 3, 4\)"):
        grouped_attention(q, k[0], k[0])
    with pytest.raises(ValueError, match=r"same number of heads Hkv"):
        grouped_attention(q, randn(gen, 1, 2, 3, 4), randn(gen, 1, 3, 3, 4))
    with pytest.raises(ValueError, match=r"does not broadcast to the scores' shape"):
        grouped_attention(q, k[:, :2], k[:, :2], torch.ones(4, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"x must be \(B, Hkv, S, D\)"):
        repeat_kv(randn(gen, 1, 2, 3, 4, 5), 2)
    module = GroupedQueryAttention(16, 4, 2)
    with pytest.raises(ValueError, match=r"batch-first \(B, L, E\)"):
        module(torch.randn(5, 16))


def test_kv_cache_bytes_and_comparison():
    assert kv_cache_bytes(batch_size=2, seq_len=10, num_kv_heads=3, head_dim=4, num_layers=5, dtype=torch.float16) == (
        2 * 5 * 2 * 10 * 3 * 4 * 2
    )
    rows = compare_kv_cache_memory(d_model=512, num_heads=8, seq_len=1024, num_layers=6, dtype=torch.bfloat16)
    assert [r["name"] for r in rows] == ["MHA", "GQA-4", "GQA-2", "MQA"]
    assert [r["fraction"] for r in rows] == [1.0, 0.5, 0.25, 0.125]
    assert rows[0]["bytes"] == 2 * 6 * 1 * 1024 * 8 * 64 * 2
    with pytest.raises(ValueError, match=r"num_heads=8 is not divisible by num_kv_heads=3"):
        compare_kv_cache_memory(d_model=512, num_heads=8, kv_heads=(3,))
    with pytest.raises(ValueError, match=r"seq_len must be >= 1, got 0"):
        kv_cache_bytes(batch_size=1, seq_len=0, num_kv_heads=1, head_dim=4)


def test_on_device_with_gradients(device):
    torch.manual_seed(0)
    module = GroupedQueryAttention(32, 8, 2, device=device)
    x = torch.randn(2, 9, 32, device=device, requires_grad=True)
    out = module(x, mask=ac.padding_mask([9, 5], device=device)[:, None, None, :], is_causal=True)
    assert out.shape == (2, 9, 32) and torch.isfinite(out).all()
    out.square().mean().backward()
    for name, p in module.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name
    assert torch.isfinite(x.grad).all()
    autocast_dtype = torch.bfloat16 if device.type == "cpu" else torch.float16
    with torch.autocast(device_type=device.type, dtype=autocast_dtype):
        low = module(x.detach(), is_causal=True)
    assert torch.isfinite(low).all()
