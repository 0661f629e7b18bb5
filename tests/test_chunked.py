"""Chunked attention (query chunks; query+key chunks with the online softmax) against dense attention."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import attn_course as ac
from attn_course.chunked import (
    PartialAttention,
    chunked_attention,
    finish_partial,
    merge_partials,
    partial_attention,
    query_chunked_attention,
)
from attn_course.measure import largest_tensor_bytes

F64 = {"atol": 1e-10, "rtol": 1e-10}


def randn(gen: torch.Generator, *shape: int, dtype=torch.float64, requires_grad=False) -> torch.Tensor:
    return torch.randn(*shape, generator=gen, dtype=dtype).requires_grad_(requires_grad)


def qkv(gen, L, S, *, D=8, Dv=5, batch=(2, 3), grad=True):
    return (
        randn(gen, *batch, L, D, requires_grad=grad),
        randn(gen, *batch, S, D, requires_grad=grad),
        randn(gen, *batch, S, Dv, requires_grad=grad),
    )


def mask_with_empty_row(gen, L, S):
    """A (2, 1, L, S) mask that really masks (about half the pairs) and has one fully-masked row."""
    mask = torch.rand(2, 1, L, S, generator=gen) < 0.5
    mask[1, 0, L // 2] = False
    return mask


def dense(q, k, v, mask=None, is_causal=False):
    return ac.scaled_dot_product_attention(q, k, v, mask, is_causal=is_causal, fused=False)


def assert_same_values_and_grads(got, expected, inputs):
    torch.testing.assert_close(got, expected, **F64)
    upstream = torch.randn(got.shape, generator=torch.Generator().manual_seed(7), dtype=got.dtype)
    got_grads = torch.autograd.grad(got, inputs, upstream)
    expected_grads = torch.autograd.grad(expected, inputs, upstream)
    for name, g, e in zip("qkv", got_grads, expected_grads):
        torch.testing.assert_close(g, e, **F64, msg=lambda m, name=name: f"grad of {name}: {m}")


# L and S are never multiples of the chunk; 1, 97 and >= L are the sizes the course promises.
CHUNK_CASES = [
    pytest.param(13, 11, 1, 1, id="chunk1"),
    pytest.param(200, 150, 97, 97, id="chunk97"),
    pytest.param(200, 150, 256, 256, id="chunk>=L"),
    pytest.param(200, 150, 97, 1000, id="q97-kall"),
    pytest.param(30, 41, 1, 97, id="q1-k97"),
]


@pytest.mark.parametrize("recompute", [True, False], ids=["recompute", "autograd"])
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("with_mask", [False, True], ids=["nomask", "mask"])
@pytest.mark.parametrize("L,S,cq,ck", CHUNK_CASES)
def test_chunked_equals_dense_values_and_grads(gen, L, S, cq, ck, with_mask, is_causal, recompute):
    q, k, v = qkv(gen, L, S)
    mask = mask_with_empty_row(gen, L, S) if with_mask else None
    got = chunked_attention(
        q, k, v, mask, query_chunk_size=cq, key_chunk_size=ck, is_causal=is_causal, recompute=recompute
    )
    assert_same_values_and_grads(got, dense(q, k, v, mask, is_causal), (q, k, v))


@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("chunk", [1, 97, 256])
def test_query_chunked_equals_dense(gen, chunk, is_causal):
    L, S = (13, 11) if chunk == 1 else (200, 150)
    q, k, v = qkv(gen, L, S)
    mask = mask_with_empty_row(gen, L, S)
    got = query_chunked_attention(q, k, v, mask, chunk_size=chunk, is_causal=is_causal)
    assert_same_values_and_grads(got, dense(q, k, v, mask, is_causal), (q, k, v))


def test_matches_pytorch_and_shared_keys_broadcast(gen):
    """Against PyTorch's own kernel; k, v shared by every batch entry (batch dim 1) get summed gradients."""
    q = randn(gen, 2, 4, 50, 8, requires_grad=True)
    k = randn(gen, 1, 4, 70, 8, requires_grad=True)
    v = randn(gen, 1, 4, 70, 6, requires_grad=True)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k.expand(2, -1, -1, -1), v.expand(2, -1, -1, -1))
    got = chunked_attention(q, k, v, query_chunk_size=16, key_chunk_size=23)
    assert got.shape == (2, 4, 50, 6)
    assert_same_values_and_grads(got, expected, (q, k, v))


@pytest.mark.parametrize("recompute", [True, False], ids=["recompute", "autograd"])
def test_gradcheck(gen, recompute):
    q, k, v = qkv(gen, 7, 9, D=3, Dv=2, batch=(2,))
    mask = torch.rand(2, 7, 9, generator=gen) < 0.6
    mask[0, 3] = False  # a fully-masked row

    def fn(q, k, v):
        return chunked_attention(q, k, v, mask, query_chunk_size=3, key_chunk_size=4, is_causal=True,
                                 recompute=recompute)

    assert torch.autograd.gradcheck(fn, (q, k, v))


@pytest.mark.parametrize("recompute", [True, False], ids=["recompute", "autograd"])
def test_fully_masked_rows_give_zeros_and_finite_grads(gen, recompute):
    q, k, v = qkv(gen, 10, 12)
    mask = torch.ones(10, 12, dtype=torch.bool)
    mask[[0, 4, 9]] = False
    out = chunked_attention(q, k, v, mask, query_chunk_size=3, key_chunk_size=5, recompute=recompute)
    assert torch.equal(out[..., [0, 4, 9], :], torch.zeros_like(out[..., [0, 4, 9], :]))
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    assert all(torch.isfinite(g).all() for g in grads)
    assert torch.equal(grads[0][..., [0, 4, 9], :], torch.zeros_like(grads[0][..., [0, 4, 9], :]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_finite_and_accurate_with_logits_scaled_50x(gen, dtype):
    """Scores in the thousands: exp overflows without the running max (the online softmax keeps it)."""
    q, k, v = (x.detach() for x in qkv(gen, 100, 90, grad=False))
    q = q * 50
    expected = dense(q, k, v)  # float64 oracle
    got = chunked_attention(q.to(dtype), k.to(dtype), v.to(dtype), query_chunk_size=32, key_chunk_size=17)
    assert got.dtype == dtype and torch.isfinite(got).all()
    # Against the float64 oracle of the same (rounded) inputs. Low precision: computed in float32, rounded
    # once, so within one rounding step at the largest output (eps * max|out|); measured 0.27 (fp16) and
    # 0.26 (bf16) of it. float32: scores in the thousands amplify float32's rounding; measured 9.8e-6,
    # so 5e-5. Was 1e-3 (fp32), 0.1 (fp16), 0.3 (bf16).
    rounded = dense(q.to(dtype).double(), k.to(dtype).double(), v.to(dtype).double())
    tol = 5e-5 if dtype == torch.float32 else torch.finfo(dtype).eps * rounded.abs().max().item()
    torch.testing.assert_close(got.double(), rounded, atol=tol, rtol=0)
    if dtype == torch.float32:
        torch.testing.assert_close(got.double(), expected, atol=5e-5, rtol=0)  # measured 1.2e-5


def test_under_autocast_matches_float32(gen):
    q, k, v = (x.detach().float() for x in qkv(gen, 64, 64, grad=False))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = chunked_attention(q, k, v, query_chunk_size=16, key_chunk_size=16, is_causal=True)
    assert got.dtype == torch.float32  # autocast is paused inside: computed in float32
    torch.testing.assert_close(got, dense(q, k, v, is_causal=True), atol=1e-5, rtol=1e-5)


def test_online_softmax_building_blocks(gen):
    """Two chunks merged with the running statistics equal one softmax over all keys, in any order."""
    scores = randn(gen, 3, 5, 12) * 10
    v = randn(gen, 3, 12, 4)
    scores[0, 1, :] = float("-inf")  # a row with no allowed key
    whole = finish_partial(partial_attention(scores, v))
    first, second = partial_attention(scores[..., :7], v[..., :7, :]), partial_attention(scores[..., 7:], v[..., 7:, :])
    for merged in (merge_partials(first, second), merge_partials(second, first)):
        assert isinstance(merged, PartialAttention)
        torch.testing.assert_close(finish_partial(merged), whole, **F64)
        torch.testing.assert_close(merged.row_max, scores.amax(-1, keepdim=True), **F64)
    expected = torch.softmax(scores[1:], dim=-1) @ v[1:]
    torch.testing.assert_close(whole[1:], expected, **F64)
    assert torch.equal(whole[0, 1], torch.zeros(4, dtype=torch.float64))


def test_never_forms_the_full_score_matrix(gen):
    L = S = 512
    q, k, v = (x.detach() for x in qkv(gen, L, S, D=16, Dv=16, batch=(1, 2), grad=False))
    score_bytes = 2 * L * S * 8  # one (B, H, L, S) float64 matrix
    assert largest_tensor_bytes(dense, q, k, v) >= score_bytes  # the measurement sees dense's matrix
    largest = largest_tensor_bytes(chunked_attention, q, k, v, query_chunk_size=64, key_chunk_size=128)
    assert largest <= 2 * 64 * 128 * 8 * 2, largest  # about one (chunk x chunk) block, never L x S


def _matmul_flops(fn) -> int:
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


@pytest.mark.parametrize(
    "L,S,computed_pairs",
    [
        # 4 x 4 chunks of 16: the 1 + 2 + 3 + 4 = 10 blocks on or below the diagonal, of 16
        pytest.param(64, 64, 10 * 16 * 16, id="L=S"),
        # query chunks [0, 16), [16, 32), [32, 40) read keys [0, 16), [0, 32), [0, 40): 16*16 + 16*32 + 8*48
        pytest.param(40, 64, 16 * 16 + 16 * 32 + 8 * 48, id="L<S"),
        # queries past S see every key: 16*16 + 16*32 + 16*40 + 16*40
        pytest.param(64, 40, 16 * 16 + 16 * 32 + 16 * 40 + 16 * 40, id="L>S"),
    ],
)
def test_causal_skips_key_chunks_in_the_future(gen, L, S, computed_pairs):
    """Under is_causal, a key chunk that starts after a query chunk's last query is never computed, forward or backward.

    Counted with FlopCounterMode (matrix products only): each computed (query, key) pair costs 2 (D + Dv) FLOPs per
    batch element and head forward; a training step with recompute costs 2 (4 D + 3 Dv) per pair.
    """
    D = Dv = 8
    q, k, v = qkv(gen, L, S, D=D, Dv=Dv, batch=(1, 2))

    def run(is_causal):
        return chunked_attention(q, k, v, query_chunk_size=16, key_chunk_size=16, is_causal=is_causal)

    with torch.no_grad():
        assert _matmul_flops(lambda: run(False)) == 2 * 2 * L * S * (D + Dv)  # every pair, as a reference
        assert _matmul_flops(lambda: run(True)) == 2 * 2 * computed_pairs * (D + Dv)
    assert _matmul_flops(lambda: run(True).sum().backward()) == 2 * 2 * computed_pairs * (4 * D + 3 * Dv)


def _saved_bytes(fn) -> int:
    total = 0

    def pack(tensor):
        nonlocal total
        total += tensor.untyped_storage().nbytes() if tensor.layout == torch.strided else 0
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = fn()
    return total, out


def test_recompute_saves_no_weights_for_backward(gen):
    """The custom autograd function keeps O(L + S) for backward; plain autograd keeps every chunk's weights."""
    L = S = 256
    q, k, v = qkv(gen, L, S, D=16, Dv=16, batch=(1, 2))
    weights_bytes = 2 * L * S * 8
    saved_recompute, out1 = _saved_bytes(lambda: chunked_attention(q, k, v, query_chunk_size=32, key_chunk_size=32))
    saved_autograd, out2 = _saved_bytes(
        lambda: chunked_attention(q, k, v, query_chunk_size=32, key_chunk_size=32, recompute=False)
    )
    assert saved_recompute < weights_bytes / 2, saved_recompute  # q, k, v, out, lse only
    assert saved_autograd > weights_bytes, saved_autograd
    torch.testing.assert_close(out1, out2, **F64)


@settings(max_examples=25, deadline=None)
@given(
    L=st.integers(1, 24), S=st.integers(1, 24), cq=st.integers(1, 30), ck=st.integers(1, 30),
    is_causal=st.booleans(), seed=st.integers(0, 2**16),
)
def test_property_any_sizes_equal_dense(L, S, cq, ck, is_causal, seed):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = qkv(gen, L, S, batch=(2,), grad=False)
    mask = torch.rand(2, L, S, generator=gen) < 0.7
    got = chunked_attention(q, k, v, mask, query_chunk_size=cq, key_chunk_size=ck, is_causal=is_causal)
    torch.testing.assert_close(got, dense(q, k, v, mask, is_causal), **F64)


def test_on_device_matches_cpu(device, gen):
    q, k, v = (x.detach().float() for x in qkv(gen, 70, 60, grad=False))
    mask = mask_with_empty_row(gen, 70, 60)
    expected = chunked_attention(q, k, v, mask, query_chunk_size=32, key_chunk_size=16, is_causal=True)
    got = chunked_attention(q.to(device), k.to(device), v.to(device), mask.to(device),
                            query_chunk_size=32, key_chunk_size=16, is_causal=True)
    assert got.device.type == device.type
    torch.testing.assert_close(got.cpu(), expected, atol=1e-5, rtol=1e-5)


q4, k4, v4 = torch.randn(2, 4, 6, 8), torch.randn(2, 4, 7, 8), torch.randn(2, 4, 7, 8)


@pytest.mark.parametrize(
    "kwargs,error,pattern",
    [
        ({"mask": torch.zeros(6, 7)}, TypeError, r"boolean mask \(True = may attend\), got dtype torch.float32"),
        ({"mask": torch.ones(7, 6, dtype=torch.bool)}, ValueError, r"\(7, 6\) does not broadcast.*swapped"),
        ({"query_chunk_size": 0}, ValueError, r"query_chunk_size must be >= 1, got 0"),
        ({"key_chunk_size": 2.5}, TypeError, r"key_chunk_size must be an int, got float"),
        ({"scale": "big"}, TypeError, r"scale must be a float or None, got str"),
        ({"k": torch.randn(2, 4, 7, 5)}, ValueError, r"same last dim D"),
    ],
    ids=["float-mask", "swapped-mask", "zero-chunk", "float-chunk", "bad-scale", "head-dim"],
)
def test_bad_input_errors(kwargs, error, pattern):
    args = {"q": q4, "k": k4, "v": v4, **kwargs}
    with pytest.raises(error, match=pattern):
        chunked_attention(args.pop("q"), args.pop("k"), args.pop("v"), **args)


def test_query_chunked_rejects_bad_chunk():
    with pytest.raises(ValueError, match=r"chunk_size must be >= 1, got -3"):
        query_chunked_attention(q4, k4, v4, chunk_size=-3)
