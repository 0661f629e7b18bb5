"""scaled_dot_product_attention against PyTorch's own, in float64, with real masks and gradients."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import attn_course as ac

F64 = {"atol": 1e-10, "rtol": 1e-10}


def randn(gen: torch.Generator, *shape: int, dtype=torch.float64, device="cpu") -> torch.Tensor:
    return torch.randn(*shape, generator=gen, dtype=dtype).to(device)


def random_mask(gen: torch.Generator, *shape: int, p: float = 0.6, no_empty_rows: bool = True) -> torch.Tensor:
    mask = torch.rand(*shape, generator=gen) < p
    if no_empty_rows:
        mask[..., 0] = True  # every query may see at least key 0
    return mask


def dense_reference(q, k, v, allowed: torch.Tensor | None, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """An independent float64 oracle: plain softmax over allowed keys, zero rows where none is allowed."""
    scores = (q @ k.transpose(-2, -1)) * scale
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    empty = torch.isneginf(scores).all(-1, keepdim=True)
    weights = torch.softmax(scores.masked_fill(empty, 0.0), dim=-1).masked_fill(empty, 0.0)
    return weights @ v, weights


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize(
    "mask_shape",
    [None, (6, 9), (2, 1, 1, 9), (2, 3, 6, 9), (1, 3, 6, 9), (3, 1, 9)],
    ids=["none", "LS", "B11S", "BHLS", "1HLS", "H1S"],
)
def test_matches_torch_bool_masks(gen, fused, mask_shape):
    q, k, v = randn(gen, 2, 3, 6, 8), randn(gen, 2, 3, 9, 8), randn(gen, 2, 3, 9, 5)
    mask = None if mask_shape is None else random_mask(gen, *mask_shape)
    got = ac.scaled_dot_product_attention(q, k, v, mask, fused=fused)
    # PyTorch's kernel is the oracle of the explicit path. The fused path *is* PyTorch's kernel, so
    # comparing it with PyTorch would be a tautology: it is held to the independent float64 oracle.
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask) if not fused else dense_reference(
        q, k, v, mask, 1 / math.sqrt(8)
    )[0]
    torch.testing.assert_close(got, expected, **F64)


@pytest.mark.parametrize(
    "mask_shape", [(6, 9), (2, 1, 1, 9), (2, 3, 6, 9), (1, 3, 6, 9), (3, 1, 9)], ids=["LS", "B11S", "BHLS", "1HLS", "H1S"]
)
def test_fused_path_gives_zero_rows_for_empty_rows(gen, mask_shape):
    """What the fused path adds to PyTorch's kernel: rows with nothing to attend to give 0, with finite gradients.

    Some backends give NaN there (the math backend, several GPU kernels); CPU's flash kernel gives 0 itself.
    Either way the result is held to the independent float64 oracle, values and gradients.
    """
    q, k, v = (randn(gen, 2, 3, n, 8).requires_grad_() for n in (6, 9, 9))
    mask = random_mask(gen, *mask_shape)
    mask.view(-1, mask.shape[-1])[0] = False  # one (broadcast) row of the mask allows no key
    got = ac.scaled_dot_product_attention(q, k, v, mask, fused=True)
    expected, _ = dense_reference(q, k, v, mask, 1 / math.sqrt(8))
    torch.testing.assert_close(got, expected, **F64)
    assert (got[~mask.expand(2, 3, 6, 9).any(-1)] == 0).all()
    weight = randn(gen, *got.shape)
    for a, b in zip(torch.autograd.grad((got * weight).sum(), (q, k, v)), torch.autograd.grad((expected * weight).sum(), (q, k, v))):
        torch.testing.assert_close(a, b, **F64)


@pytest.mark.parametrize("fused", [False, True])
def test_matches_torch_float_mask(gen, fused):
    q, k, v = randn(gen, 2, 4, 7, 8), randn(gen, 2, 4, 7, 8), randn(gen, 2, 4, 7, 8)
    bias = randn(gen, 1, 4, 7, 7)  # e.g. a relative-position bias, broadcast over the batch
    allowed = random_mask(gen, 1, 4, 7, 7)
    if fused:
        allowed[0, 1, 3] = False  # an all -inf row: some backends give NaN, ours must give 0
    bias = bias.masked_fill(~allowed, float("-inf"))
    got = ac.scaled_dot_product_attention(q, k, v, bias, fused=fused)
    if fused:  # the fused path is PyTorch's kernel: hold it to an independent oracle with the bias added
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(8) + bias
        expected = torch.softmax(scores, dim=-1).nan_to_num(0.0) @ v
    else:
        expected = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
    torch.testing.assert_close(got, expected, **F64)


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("L,S", [(5, 5), (3, 8), (8, 3)], ids=["L=S", "L<S", "L>S"])
def test_is_causal_top_left_like_torch(gen, fused, L, S):
    q, k, v = randn(gen, 2, 2, L, 4), randn(gen, 2, 2, S, 4), randn(gen, 2, 2, S, 4)
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    got = ac.scaled_dot_product_attention(q, k, v, is_causal=True, fused=fused)
    torch.testing.assert_close(got, expected, **F64)
    # ... and, for the fused path (PyTorch's kernel itself), the independent oracle with a top-left mask
    torch.testing.assert_close(got, dense_reference(q, k, v, torch.ones(L, S, dtype=torch.bool).tril(), 0.5)[0], **F64)
    # and it is the same as passing the explicit causal mask
    torch.testing.assert_close(got, ac.scaled_dot_product_attention(q, k, v, ac.causal_mask(L, S)), **F64)


@pytest.mark.parametrize("fused", [False, True])
def test_is_causal_combines_with_mask(gen, fused):
    q, k, v = randn(gen, 2, 6, 4), randn(gen, 2, 6, 4), randn(gen, 2, 6, 4)
    pad = ac.padding_mask([6, 4])[:, None, :]  # (B, 1, S)
    got = ac.scaled_dot_product_attention(q, k, v, pad, is_causal=True, fused=fused)
    expected, _ = dense_reference(q, k, v, pad & ac.causal_mask(6), 0.5)
    torch.testing.assert_close(got, expected, **F64)


@pytest.mark.parametrize("fused", [False, True])
def test_custom_scale(gen, fused):
    q, k, v = randn(gen, 3, 5, 16), randn(gen, 3, 7, 16), randn(gen, 3, 7, 2)
    expected = F.scaled_dot_product_attention(q, k, v, scale=0.37)
    got = ac.scaled_dot_product_attention(q, k, v, scale=0.37, fused=fused)
    torch.testing.assert_close(got, expected, **F64)
    torch.testing.assert_close(got, dense_reference(q, k, v, None, 0.37)[0], **F64)  # not only PyTorch's word
    default = ac.scaled_dot_product_attention(q, k, v, fused=fused)
    assert not torch.allclose(got, default), "the scale argument must change the result"


def test_weights_are_softmax_rows(gen):
    q, k, v = randn(gen, 2, 6, 4), randn(gen, 2, 9, 4), randn(gen, 2, 9, 4)
    mask = random_mask(gen, 2, 6, 9)
    out, weights = ac.scaled_dot_product_attention(q, k, v, mask, need_weights=True)
    ref_out, ref_weights = dense_reference(q, k, v, mask, 0.5)
    torch.testing.assert_close(weights, ref_weights, **F64)
    torch.testing.assert_close(out, ref_out, **F64)
    torch.testing.assert_close(weights.sum(-1), torch.ones(2, 6, dtype=torch.float64), **F64)
    assert (weights[~mask] == 0).all(), "blocked keys must get exactly zero weight"


@pytest.mark.parametrize("fused", [False, True])
def test_fully_masked_rows_give_zeros_and_finite_gradients(gen, fused):
    q, k, v = (randn(gen, 2, 5, 4).requires_grad_() for _ in range(3))
    mask = random_mask(gen, 2, 5, 5)
    mask[0, 2] = False  # query 2 of batch 0 may attend to nothing
    mask[1, :] = False  # batch 1: nothing may attend anywhere
    out = ac.scaled_dot_product_attention(q, k, v, mask, fused=fused)
    assert torch.isfinite(out).all()
    assert (out[0, 2] == 0).all() and (out[1] == 0).all()
    expected, _ = dense_reference(q, k, v, mask, 0.5)
    torch.testing.assert_close(out, expected, **F64)
    out.sum().backward()
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()
    assert (q.grad[0, 2] == 0).all() and (q.grad[1] == 0).all(), "an empty row has no dependence on q"


def test_fully_masked_rows_weights_zero(gen):
    q, k, v = randn(gen, 4, 4), randn(gen, 4, 4), randn(gen, 4, 4)
    mask = torch.ones(4, 4, dtype=torch.bool)
    mask[1] = False
    _, weights = ac.scaled_dot_product_attention(q, k, v, mask, need_weights=True)
    assert (weights[1] == 0).all()
    torch.testing.assert_close(weights[[0, 2, 3]].sum(-1), torch.ones(3, dtype=torch.float64))


@pytest.mark.parametrize("fused", [False, True])
def test_fully_masked_rows_float_mask(gen, fused):
    q, k, v = randn(gen, 3, 4), randn(gen, 3, 4), randn(gen, 3, 4)
    bias = torch.zeros(3, 3, dtype=torch.float64)
    bias[1] = float("-inf")
    out = ac.scaled_dot_product_attention(q, k, v, bias, fused=fused)
    assert (out[1] == 0).all() and torch.isfinite(out).all()


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_gradients_match_torch(gen, fused, causal):
    q, k, v = (randn(gen, 2, 2, 6, 4).requires_grad_() for _ in range(3))
    mask = None if causal else random_mask(gen, 2, 1, 6, 6)
    ours = ac.scaled_dot_product_attention(q, k, v, mask, is_causal=causal, fused=fused)
    grads = torch.autograd.grad(ours.pow(2).sum(), (q, k, v))
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)
    ref_grads = torch.autograd.grad(ref.pow(2).sum(), (q, k, v))
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, **F64)


@pytest.mark.parametrize("fused", [False, True])
def test_gradcheck(gen, fused):
    q, k, v = (randn(gen, 2, 4, 3).requires_grad_() for _ in range(3))
    mask = random_mask(gen, 2, 4, 4)
    mask[1, 3] = False  # include an empty row: its gradient must be 0 and well defined

    def fn(q, k, v):
        return ac.scaled_dot_product_attention(q, k, v, mask, fused=fused)

    assert torch.autograd.gradcheck(fn, (q, k, v))


@pytest.mark.parametrize("mask_kind", ["none", "bool", "float", "causal"])
def test_explicit_and_fused_agree(gen, mask_kind):
    q, k, v = randn(gen, 3, 2, 10, 8), randn(gen, 3, 2, 12, 8), randn(gen, 3, 2, 12, 8)
    mask, causal = None, False
    if mask_kind == "bool":
        mask = random_mask(gen, 3, 1, 10, 12)
    elif mask_kind == "float":
        mask = randn(gen, 10, 12)
    elif mask_kind == "causal":
        causal = True
    a = ac.scaled_dot_product_attention(q, k, v, mask, is_causal=causal, fused=False)
    b = ac.scaled_dot_product_attention(q, k, v, mask, is_causal=causal, fused=True)
    torch.testing.assert_close(a, b, **F64)


def test_default_path_choice(gen):
    q = randn(gen, 2, 3, 4)
    out = ac.scaled_dot_product_attention(q, q, q)
    assert isinstance(out, torch.Tensor)
    out2, weights = ac.scaled_dot_product_attention(q, q, q, need_weights=True)
    assert weights.shape == (2, 3, 3)
    torch.testing.assert_close(out, out2, **F64)


def test_dropout_is_unbiased_and_active(gen):
    torch.manual_seed(0)
    q, k, v = randn(gen, 1, 8, 4), randn(gen, 1, 8, 4), randn(gen, 1, 8, 4)
    plain = ac.scaled_dot_product_attention(q, k, v, fused=False)
    samples = torch.stack([ac.scaled_dot_product_attention(q, k, v, dropout_p=0.3, fused=False) for _ in range(4000)])
    assert not torch.allclose(samples[0], plain), "dropout must change a single sample"
    torch.testing.assert_close(samples.mean(0), plain, atol=0.05, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("fused", [False, True])
def test_low_precision_is_finite_with_huge_logits_and_masks(gen, dtype, fused):
    q = (randn(gen, 2, 2, 16, 8) * 300).to(dtype)  # logits far beyond fp16's 65504 range
    k = (randn(gen, 2, 2, 16, 8) * 300).to(dtype)
    v = randn(gen, 2, 2, 16, 8).to(dtype)
    mask = random_mask(gen, 2, 1, 16, 16)
    mask[0, 0, 3] = False
    if fused and dtype == torch.float16:
        # The fused kernel computes scores in low precision; keep them in fp16's range.
        q, k = q / 300, k / 300
    out = ac.scaled_dot_product_attention(q, k, v, mask, is_causal=True, fused=fused)
    assert out.dtype == dtype
    assert torch.isfinite(out).all()
    expected, _ = dense_reference(q.double(), k.double(), v.double(), mask & ac.causal_mask(16), 1 / math.sqrt(8))
    # Within one rounding step of the dtype at the largest output (eps * max|out|). Measured: 0 on the
    # explicit path (the weights round to one-hot) and for fused bf16, 0.22 of it for fused fp16.
    # Was atol = rtol = 0.02 (fp16) and 0.06 (bf16): up to 0.3 on outputs near 3.7.
    tol = torch.finfo(dtype).eps * expected.abs().max().item()
    torch.testing.assert_close(out.double(), expected, atol=tol, rtol=0)


@settings(max_examples=60, deadline=None)
@given(
    batch=st.lists(st.integers(1, 3), min_size=0, max_size=2),
    L=st.integers(1, 9),
    S=st.integers(1, 9),
    D=st.integers(1, 6),
    Dv=st.integers(1, 6),
    causal=st.booleans(),
    use_mask=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_property_explicit_fused_and_oracle_agree(batch, L, S, D, Dv, causal, use_mask, seed):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = randn(gen, *batch, L, D), randn(gen, *batch, S, D), randn(gen, *batch, S, Dv)
    mask = random_mask(gen, *batch, L, S, p=0.5, no_empty_rows=False) if use_mask else None
    allowed = ac.combine_masks(mask, ac.causal_mask(L, S) if causal else None)
    expected, expected_w = dense_reference(q, k, v, allowed, 1 / math.sqrt(D))
    out, weights = ac.scaled_dot_product_attention(q, k, v, mask, is_causal=causal, need_weights=True)
    fused = ac.scaled_dot_product_attention(q, k, v, mask, is_causal=causal, fused=True)
    torch.testing.assert_close(out, expected, **F64)
    torch.testing.assert_close(weights, expected_w, **F64)
    torch.testing.assert_close(fused, expected, **F64)


def test_on_device(device, gen):
    """The same numbers on every available device, explicit and fused, in float32."""
    q, k, v = randn(gen, 2, 4, 32, 16, dtype=torch.float32), randn(gen, 2, 4, 32, 16, dtype=torch.float32), randn(
        gen, 2, 4, 32, 16, dtype=torch.float32
    )
    mask = random_mask(gen, 2, 1, 32, 32)
    mask[0, 0, 5] = False
    expected, _ = dense_reference(q.double(), k.double(), v.double(), mask & ac.causal_mask(32), 0.25)
    for fused in (False, True):
        out = ac.scaled_dot_product_attention(
            q.to(device), k.to(device), v.to(device), mask.to(device), is_causal=True, fused=fused
        )
        assert out.device.type == device.type
        torch.testing.assert_close(out.cpu().double(), expected, atol=1e-5, rtol=1e-5)


def test_on_device_low_precision(device, gen):
    dtype = torch.float16 if device.type != "cpu" else torch.bfloat16
    q, k, v = (randn(gen, 1, 2, 64, 32).to(device, dtype) for _ in range(3))
    mask = random_mask(gen, 64, 64).to(device)
    mask[7] = False
    for fused in (False, True):
        out = ac.scaled_dot_product_attention(q, k, v, mask, fused=fused)
        assert torch.isfinite(out).all() and (out[..., 7, :] == 0).all()
