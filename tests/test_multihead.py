"""MultiHeadAttention against torch.nn.MultiheadAttention, loaded with from_torch."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import attn_course as ac


def make_pair(E=16, H=4, *, dtype=torch.float64, bias=True, kdim=None, vdim=None, seed=0):
    torch.manual_seed(seed)
    ref = nn.MultiheadAttention(E, H, bias=bias, kdim=kdim, vdim=vdim, batch_first=True, dtype=dtype)
    # Non-zero biases so a bias mix-up cannot hide behind PyTorch's zero initialisation.
    if bias:
        with torch.no_grad():
            ref.in_proj_bias.normal_()
            ref.out_proj.bias.normal_()
    return ref, ac.MultiHeadAttention.from_torch(ref)


TOL = {torch.float64: {"atol": 1e-10, "rtol": 1e-10}, torch.float32: {"atol": 1e-5, "rtol": 1e-5}}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("H", [1, 2, 4, 8])
def test_self_attention_matches_torch(dtype, H):
    ref, ours = make_pair(16, H, dtype=dtype)
    x = torch.randn(3, 7, 16, dtype=dtype)
    expected, expected_w = ref(x, x, x, need_weights=True, average_attn_weights=False)
    out, weights = ours(x, need_weights=True)
    torch.testing.assert_close(out, expected, **TOL[dtype])
    torch.testing.assert_close(weights, expected_w, **TOL[dtype])
    assert weights.shape == (3, H, 7, 7)
    torch.testing.assert_close(ours(x), expected, **TOL[dtype])  # fused path, no weights


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_padding_mask_matches_torch(dtype):
    ref, ours = make_pair(dtype=dtype)
    x = torch.randn(3, 6, 16, dtype=dtype)
    lengths = torch.tensor([6, 4, 1])
    keep = ac.padding_mask(lengths)  # (B, S), True = real token
    expected, expected_w = ref(
        x, x, x, key_padding_mask=ac.to_blocked_mask(keep), need_weights=True, average_attn_weights=False
    )
    out, weights = ours(x, mask=keep[:, None, None, :], need_weights=True)
    torch.testing.assert_close(out, expected, **TOL[dtype])
    torch.testing.assert_close(weights, expected_w, **TOL[dtype])
    assert (weights[1, :, :, 4:] == 0).all(), "padded keys must get zero weight"


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_causal_and_padding_match_torch(dtype):
    ref, ours = make_pair(dtype=dtype)
    x = torch.randn(2, 5, 16, dtype=dtype)
    keep = ac.padding_mask([5, 3])
    blocked_causal = ac.to_blocked_mask(ac.causal_mask(5))
    expected = ref(x, x, x, attn_mask=blocked_causal, key_padding_mask=~keep, need_weights=False)[0]
    got = ours(x, mask=keep[:, None, None, :], is_causal=True)
    torch.testing.assert_close(got, expected, **TOL[dtype])
    got_explicit_mask = ours(x, mask=ac.combine_masks(keep[:, None, None, :], ac.causal_mask(5)))
    torch.testing.assert_close(got_explicit_mask, expected, **TOL[dtype])


@pytest.mark.parametrize("kdim,vdim", [(None, None), (12, 20)])
def test_cross_attention_matches_torch(kdim, vdim):
    ref, ours = make_pair(16, 4, kdim=kdim, vdim=vdim)
    query = torch.randn(2, 3, 16, dtype=torch.float64)
    key = torch.randn(2, 9, kdim or 16, dtype=torch.float64)
    value = torch.randn(2, 9, vdim or 16, dtype=torch.float64)
    expected, expected_w = ref(query, key, value, average_attn_weights=False)
    out, weights = ours(query, key, value, need_weights=True)
    torch.testing.assert_close(out, expected, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(weights, expected_w, atol=1e-10, rtol=1e-10)
    assert weights.shape == (2, 4, 3, 9)


def test_no_bias_matches_torch():
    ref, ours = make_pair(bias=False)
    assert ours.q_proj.bias is None
    x = torch.randn(2, 4, 16, dtype=torch.float64)
    torch.testing.assert_close(ours(x), ref(x, x, x)[0], atol=1e-10, rtol=1e-10)


def test_gradients_match_torch():
    ref, ours = make_pair()
    x = torch.randn(2, 5, 16, dtype=torch.float64, requires_grad=True)
    mask = ac.causal_mask(5)
    ref(x, x, x, attn_mask=~mask, need_weights=False)[0].pow(2).sum().backward()
    ref_x_grad, x.grad = x.grad, None
    ours(x, mask=mask).pow(2).sum().backward()
    torch.testing.assert_close(x.grad, ref_x_grad, atol=1e-10, rtol=1e-10)
    E = 16
    w_grads = ref.in_proj_weight.grad.split(E)
    for proj, g in zip((ours.q_proj, ours.k_proj, ours.v_proj), w_grads):
        torch.testing.assert_close(proj.weight.grad, g, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(ours.out_proj.weight.grad, ref.out_proj.weight.grad, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("mask_kind", ["none", "padding", "causal"])
def test_explicit_and_fused_paths_agree(mask_kind):
    torch.manual_seed(1)
    fused = ac.MultiHeadAttention(24, 3, dtype=torch.float64)
    explicit = ac.MultiHeadAttention(24, 3, fused=False, dtype=torch.float64)
    explicit.load_state_dict(fused.state_dict())
    x = torch.randn(4, 10, 24, dtype=torch.float64)
    mask = ac.padding_mask([10, 3, 7, 1])[:, None, None, :] if mask_kind == "padding" else None
    causal = mask_kind == "causal"
    torch.testing.assert_close(
        fused(x, mask=mask, is_causal=causal), explicit(x, mask=mask, is_causal=causal), atol=1e-10, rtol=1e-10
    )


def test_dropout_only_in_training():
    torch.manual_seed(2)
    mha = ac.MultiHeadAttention(16, 4, dropout=0.5, dtype=torch.float64)
    x = torch.randn(2, 6, 16, dtype=torch.float64)
    mha.eval()
    torch.testing.assert_close(mha(x), mha(x))
    mha.train()
    assert not torch.allclose(mha(x), mha(x)), "dropout must be active in training mode"


def test_state_dict_keys_and_parameter_count():
    mha = ac.MultiHeadAttention(32, 4)
    assert sorted(mha.state_dict()) == sorted(
        f"{p}_proj.{w}" for p in ("q", "k", "v", "out") for w in ("weight", "bias")
    )
    ref = nn.MultiheadAttention(32, 4)
    assert sum(p.numel() for p in mha.parameters()) == sum(p.numel() for p in ref.parameters()) == 4 * (32 * 32 + 32)


def test_from_torch_rejects_unsupported():
    with pytest.raises(ValueError, match="add_bias_kv"):
        ac.MultiHeadAttention.from_torch(nn.MultiheadAttention(8, 2, add_bias_kv=True))
    with pytest.raises(TypeError, match="nn.MultiheadAttention"):
        ac.MultiHeadAttention.from_torch(nn.Linear(3, 3))


def test_from_torch_seq_first_module_weights():
    """The copy does not depend on batch_first: feed the seq-first module transposed inputs."""
    torch.manual_seed(3)
    ref = nn.MultiheadAttention(8, 2, dtype=torch.float64)  # batch_first=False
    ours = ac.MultiHeadAttention.from_torch(ref)
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    expected = ref(x.transpose(0, 1), x.transpose(0, 1), x.transpose(0, 1))[0].transpose(0, 1)
    torch.testing.assert_close(ours(x), expected, atol=1e-10, rtol=1e-10)


def test_split_merge_round_trip_and_token_mixing():
    x = torch.randn(2, 5, 12)
    heads = ac.split_heads(x, 3)
    assert heads.shape == (2, 3, 5, 4)
    assert heads.data_ptr() == x.data_ptr(), "split_heads is a view, no copy"
    assert not heads.is_contiguous()
    torch.testing.assert_close(ac.merge_heads(heads), x, atol=0, rtol=0)
    # The source article's bug: merging by reshape without moving heads back mixes tokens.
    wrong = heads.reshape(2, 5, 12)
    assert not torch.equal(wrong, x)


def test_on_device(device):
    torch.manual_seed(4)
    ref = nn.MultiheadAttention(32, 4, batch_first=True)
    ours = ac.MultiHeadAttention.from_torch(ref).to(device)
    x = torch.randn(2, 9, 32)
    keep = ac.padding_mask([9, 4])
    expected = ref(x, x, x, key_padding_mask=~keep)[0]
    got = ours(x.to(device), mask=keep[:, None, None, :].to(device))
    torch.testing.assert_close(got.cpu(), expected, atol=1e-5, rtol=1e-5)
    got.sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in ours.parameters())


def test_autocast_cpu_bf16_finite():
    torch.manual_seed(5)
    mha = ac.MultiHeadAttention(32, 4)
    x = torch.randn(2, 16, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, weights = mha(x, mask=ac.causal_mask(16), need_weights=True)
        fused = mha(x, is_causal=True)
    assert torch.isfinite(out).all() and torch.isfinite(weights).all() and torch.isfinite(fused).all()


def test_autocast_accepts_low_precision_activations():
    """Inside autocast, bf16 activations (e.g. from an earlier autocast layer) meet fp32 weights."""
    torch.manual_seed(6)
    mha = ac.MultiHeadAttention(32, 4)
    x = torch.randn(2, 8, 32).to(torch.bfloat16)
    with pytest.raises(TypeError, match="dtype torch.bfloat16 but the module's weights are torch.float32"):
        mha(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = mha(x, is_causal=True)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()


# ---------------------------------------------------------------- one pipeline, one overridable step


def test_variants_override_only_the_attention_step():
    """GQA, dynamic heads and relative positions reuse MultiHeadAttention's pipeline; each overrides `attend`."""
    from attn_course.dynamic import DynamicHeadAttention
    from attn_course.grouped import GroupedQueryAttention
    from attn_course.positional import RelativePositionMultiHeadAttention

    for variant in (GroupedQueryAttention, DynamicHeadAttention, RelativePositionMultiHeadAttention):
        assert variant._project_attend_merge is ac.MultiHeadAttention._project_attend_merge, variant
        assert variant._check_inputs is ac.MultiHeadAttention._check_inputs, variant
        assert variant.attend is not ac.MultiHeadAttention.attend, variant
    assert GroupedQueryAttention.forward is ac.MultiHeadAttention.forward  # nothing to add before the pipeline


class _DoubledQueries(ac.MultiHeadAttention):
    """A learner's variant: attention with the queries doubled (i.e. softmax at temperature 1/2)."""

    def attend(self, q, k, v, **options):
        return super().attend(2 * q, k, v, **options)


def test_overriding_attend_changes_what_forward_computes():
    torch.manual_seed(0)
    module = _DoubledQueries(16, 4, dtype=torch.float64)
    x = torch.randn(2, 7, 16, dtype=torch.float64)
    keep = ac.padding_mask([7, 4])[:, None, None, :]  # (B, 1, 1, S)
    out, weights = module(x, mask=keep, is_causal=True, need_weights=True)
    # Oracle: the same projections, heads attended by PyTorch's kernel at twice the usual scale.
    q, k, v = (ac.split_heads(p(x), 4) for p in (module.q_proj, module.k_proj, module.v_proj))  # (B, H, L, D)
    allowed = keep & ac.causal_mask(7)
    context = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=2 / 2)  # D = 4
    torch.testing.assert_close(out, module.out_proj(ac.merge_heads(context)), atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(module(x, mask=keep, is_causal=True), out, atol=1e-12, rtol=1e-12)  # fused path too
    plain = ac.MultiHeadAttention(16, 4, dtype=torch.float64)
    plain.load_state_dict(module.state_dict())
    assert (plain(x, mask=keep, is_causal=True) - out).abs().max() > 1e-3  # the override really is used
    # Tools built on the step see the override: the KV cache refuses it, capture_attention reads its weights.
    with pytest.raises(TypeError, match="overrides forward or attend"):
        ac.decode_step(module, x, ac.KVCache.for_module(module, batch_size=2, max_length=7))
    with ac.capture_attention(module) as captured:
        module(x, mask=keep, is_causal=True)
    torch.testing.assert_close(captured["(model)"], weights, atol=1e-12, rtol=1e-12)
