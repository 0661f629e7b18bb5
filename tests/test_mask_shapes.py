"""Every mask shape the docstrings promise, for every attention function that takes a mask (issue 16, bug 3).

Dense-style functions take a mask broadcastable to ``(..., L, S)``; sparse and linear attention a
key-padding mask broadcastable to ``(..., 1, S)``. Before the fix a 1-D ``(S,)`` mask passed
validation and then crashed with a bare IndexError in all of them but the explicit path of
``scaled_dot_product_attention``. Each case is compared in float64, gradients included, with an
oracle written here that gets the mask already broadcast to the full ``(B, H, L, S)``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import attn_course as ac

B, H, L, S, D = 2, 3, 8, 8, 4
F64 = {"atol": 1e-10, "rtol": 1e-10}  # float64 oracles; the differences measured are below 1e-14

# Shapes broadcastable to (B, H, L, S): what scaled_dot_product_attention and the chunked functions promise.
DENSE_SHAPES = [(), (S,), (1, S), (L, 1), (L, S), (H, 1, S), (B, 1, 1, S), (B, 1, L, 1), (1, H, L, S), (B, H, L, S)]
# Shapes broadcastable to (B, H, 1, S): the key-padding masks of sparse and linear attention.
KEY_SHAPES = [(), (S,), (1, S), (1, 1), (B, 1, 1, S), (B, H, 1, S), (1, H, 1, S), (B, 1, 1, 1)]


def shape_id(shape: tuple[int, ...]) -> str:
    return "x".join(map(str, shape)) or "scalar"


def make_mask(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """A random bool mask; some rows (or, for a scalar, everything) may be fully masked."""
    gen = torch.Generator().manual_seed(seed)
    if shape == ():
        return torch.tensor(seed % 2 == 0)
    return torch.rand(shape, generator=gen) < 0.6


def inputs(seed: int = 0, *, L: int = L) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + seed)
    return tuple(
        torch.randn(B, H, n, D, generator=gen, dtype=torch.float64).requires_grad_() for n in (L, S, S)
    )


def softmax_oracle(q, k, v, allowed: torch.Tensor) -> torch.Tensor:
    """Plain float64 softmax attention over the allowed keys of a full (B, H, L, S) mask; empty rows give 0."""
    scores = (q @ k.transpose(-2, -1)) / D**0.5
    scores = scores.masked_fill(~allowed, float("-inf"))
    empty = ~allowed.any(dim=-1, keepdim=True)
    weights = torch.softmax(scores.masked_fill(empty, 0.0), dim=-1).masked_fill(empty, 0.0)
    return weights @ v


def linear_oracle(q, k, v, allowed: torch.Tensor, *, eps: float = 1e-6) -> torch.Tensor:
    """Linear attention the quadratic way with elu+1 features, over the allowed pairs."""
    phi_q, phi_k = F.elu(q) + 1, F.elu(k) + 1
    similarity = (phi_q @ phi_k.transpose(-2, -1)) * allowed
    return similarity @ v / (similarity.sum(dim=-1, keepdim=True) + eps)


def assert_matches(got: torch.Tensor, expected: torch.Tensor, leaves: tuple[torch.Tensor, ...]) -> None:
    torch.testing.assert_close(got, expected, **F64)
    weight = torch.randn(got.shape, generator=torch.Generator().manual_seed(7), dtype=got.dtype)
    got_grads = torch.autograd.grad((got * weight).sum(), leaves)
    expected_grads = torch.autograd.grad((expected * weight).sum(), leaves)
    for a, b in zip(got_grads, expected_grads):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, **F64)


DENSE_FUNCTIONS = {
    "sdpa-explicit": lambda q, k, v, m: ac.scaled_dot_product_attention(q, k, v, m, fused=False),
    "sdpa-fused": lambda q, k, v, m: ac.scaled_dot_product_attention(q, k, v, m, fused=True),
    "chunked": lambda q, k, v, m: ac.chunked_attention(q, k, v, m, query_chunk_size=3, key_chunk_size=3),
    "chunked-autograd": lambda q, k, v, m: ac.chunked_attention(
        q, k, v, m, query_chunk_size=3, key_chunk_size=3, recompute=False
    ),
    "query-chunked": lambda q, k, v, m: ac.query_chunked_attention(q, k, v, m, chunk_size=3),
    "grouped": lambda q, k, v, m: ac.grouped_attention(q, k, v, m),
}


@pytest.mark.parametrize("shape", DENSE_SHAPES, ids=shape_id)
@pytest.mark.parametrize("name", list(DENSE_FUNCTIONS))
@pytest.mark.parametrize("queries", [L, 5], ids=["L=S", "L<S"])
def test_dense_functions_take_every_broadcastable_mask(name, shape, queries):
    if queries != L:
        shape = tuple(queries if (n == L and i == len(shape) - 2) else n for i, n in enumerate(shape))
    mask = make_mask(shape, seed=len(shape))
    q, k, v = inputs(len(shape), L=queries)
    got = DENSE_FUNCTIONS[name](q, k, v, mask)
    expected = softmax_oracle(q, k, v, mask.expand(B, H, queries, S))
    assert_matches(got, expected, (q, k, v))


@pytest.mark.parametrize("fused", [False, True], ids=["explicit", "fused"])
def test_sdpa_takes_a_1d_additive_float_mask(fused):
    bias = torch.zeros(S, dtype=torch.float64)
    bias[[1, 5]] = float("-inf")
    bias[2] = 0.7  # a real bias, not only blocking
    q, k, v = inputs()
    got = ac.scaled_dot_product_attention(q, k, v, bias, fused=fused)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=bias.expand(B, H, L, S))
    assert_matches(got, expected, (q, k, v))


@pytest.mark.parametrize("shape", DENSE_SHAPES[:3], ids=shape_id)
def test_multihead_attention_takes_small_masks(shape):
    """The module passes its mask to scaled_dot_product_attention, broadcast to (B, H, L, S)."""
    torch.manual_seed(0)
    module = ac.MultiHeadAttention(12, H, dtype=torch.float64)
    x = torch.randn(B, L, 12, dtype=torch.float64)
    mask = make_mask(shape, seed=3)
    full = mask.expand(B, H, L, S)
    torch.testing.assert_close(module(x, mask=mask), module(x, mask=full.clone()), **F64)


@pytest.mark.parametrize("shape", KEY_SHAPES, ids=shape_id)
@pytest.mark.parametrize("pattern", ac.PATTERNS)
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_sparse_attention_takes_every_key_mask_shape(shape, pattern, is_causal):
    mask = make_mask(shape, seed=len(shape) + 1)
    q, k, v = inputs(len(shape))
    got = ac.sparse_attention(q, k, v, mask, pattern=pattern, size=3, num_global=1, is_causal=is_causal)
    allowed = ac.pattern_mask(L, pattern=pattern, size=3, num_global=1, is_causal=is_causal) & mask.expand(B, H, 1, S)
    assert_matches(got, softmax_oracle(q, k, v, allowed), (q, k, v))


@pytest.mark.parametrize("shape", KEY_SHAPES, ids=shape_id)
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_linear_attention_takes_every_key_mask_shape(shape, is_causal):
    mask = make_mask(shape, seed=len(shape) + 2)
    q, k, v = inputs(len(shape))
    got = ac.linear_attention(q, k, v, mask, is_causal=is_causal, chunk_size=3)  # chunks slice the key mask
    allowed = mask.expand(B, H, 1, S)
    if is_causal:
        allowed = allowed & ac.causal_mask(L)
    assert_matches(got, linear_oracle(q, k, v, allowed), (q, k, v))
    quadratic = ac.linear_attention_quadratic(q, k, v, mask, is_causal=is_causal)
    torch.testing.assert_close(quadratic, got, **F64)


@pytest.mark.parametrize(
    "call",
    [
        lambda q, k, v, m: ac.sparse_attention(q, k, v, m, pattern="block", size=3),
        lambda q, k, v, m: ac.linear_attention(q, k, v, m),
    ],
    ids=["sparse", "linear"],
)
def test_key_mask_functions_refuse_per_query_masks_with_the_reason(call):
    q, k, v = inputs()
    with pytest.raises(ValueError, match=r"key-padding mask of shape \(\.\.\., 1, S\), got \(8, 8\)"):
        call(q, k, v, torch.ones(L, S, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"does not broadcast"):
        call(q, k, v, torch.ones(S + 1, dtype=torch.bool))
