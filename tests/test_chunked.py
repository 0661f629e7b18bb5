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


# ----------------------------------------------------------------------------------------
# Memory stays chunk-sized, forward and backward; masks only where they mask


def test_backward_never_forms_the_full_score_matrix(gen):
    """The recomputing backward works block by block too: its largest tensor is one block or one (L, D) gradient."""
    L = S = 512
    q, k, v = qkv(gen, L, S, D=16, Dv=16, batch=(1, 2))
    block_bytes = 2 * 64 * 128 * 8  # one (B, H, 64, 128) float64 block
    grad_bytes = 2 * L * 16 * 8  # one (B, H, L, D) gradient

    def train_step(recompute):
        out = chunked_attention(q, k, v, query_chunk_size=64, key_chunk_size=128, recompute=recompute)
        out.square().sum().backward()

    assert largest_tensor_bytes(train_step, True) <= max(block_bytes, grad_bytes)
    q.grad = k.grad = v.grad = None
    # The measurement sees what a backward pass creates: dense attention's backward builds (L, S) matrices.
    def dense_step():
        dense(q, k, v).square().sum().backward()

    assert largest_tensor_bytes(dense_step) >= 2 * L * S * 8


def test_default_blocks_are_chunk_sized(gen):
    """With the default chunk sizes no forward tensor is larger than one 512 x 1024 block, at any length."""
    L = S = 3072
    q, k, v = (x.detach() for x in qkv(gen, L, S, D=8, Dv=8, batch=(1, 1), grad=False))
    largest = largest_tensor_bytes(chunked_attention, q, k, v)
    assert largest <= 512 * 1024 * 8, largest  # one float64 block, not (L, S) = 18x larger


class _CountOps(torch.overrides.TorchFunctionMode):
    def __init__(self, names):
        super().__init__()
        self.names, self.count = names, 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in self.names:
            self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize(
    "is_causal,with_mask,expected",
    [
        (False, False, 0),  # no mask: no block is masked
        (True, False, 4),  # 4 x 4 blocks of 16, causal: only the 4 on the diagonal cross it
        (False, True, 16),  # a mask touches every block
    ],
    ids=["plain", "causal", "mask"],
)
def test_masks_only_the_blocks_a_mask_touches(gen, monkeypatch, is_causal, with_mask, expected):
    """``masked_fill`` runs once per block that has a blocked pair, in the forward pass and again in the backward."""
    import attn_course.chunked as chunked_module

    q, k, v = qkv(gen, 64, 64, batch=(1, 2))
    mask = torch.rand(64, 64, generator=gen) < 0.5 if with_mask else None
    counter = _CountOps({"masked_fill", "masked_fill_"})
    with counter:
        out = chunked_attention(q, k, v, mask, query_chunk_size=16, key_chunk_size=16, is_causal=is_causal)
    assert counter.count == expected
    # The backward runs on autograd's thread, where a TorchFunctionMode is not active: count the blocks
    # that the shared helper hands it a mask for instead.
    masked_blocks = []
    original = chunked_module._blocked

    def counting(*args, **kwargs):
        blocked = original(*args, **kwargs)
        masked_blocks.append(blocked is not None)
        return blocked

    monkeypatch.setattr(chunked_module, "_blocked", counting)
    out.sum().backward()
    assert len(masked_blocks) == (10 if is_causal else 16)  # blocks recomputed: causal skips the 6 in the future
    assert sum(masked_blocks) == expected


_PEAK_SCRIPT = r"""
import json, sys, torch
from attn_course.chunked import chunked_attention
from attn_course.attention import scaled_dot_product_attention
from attn_course.measure import peak_memory_bytes
torch.set_num_threads(1)
name, L = sys.argv[1], int(sys.argv[2])
q, k, v = (torch.randn(1, 2, L, 64, requires_grad=True) for _ in range(3))  # (B, H, L, D), float32
fns = {"dense": lambda: scaled_dot_product_attention(q, k, v, fused=False),
       "chunked": lambda: chunked_attention(q, k, v, query_chunk_size=256, key_chunk_size=256)}
def step(L_=None):
    fns[name]().sum().backward()
    q.grad = k.grad = v.grad = None
small = [x[..., :64, :].detach().clone().requires_grad_() for x in (q, k, v)]
(chunked_attention if name == "chunked" else scaled_dot_product_attention)(*small).sum().backward()  # warm up
print(json.dumps(peak_memory_bytes(step)))
"""


@pytest.mark.skipif(not __import__("sys").platform.startswith("linux"), reason="peak RSS (VmHWM) is Linux's")
def test_training_peak_memory_is_chunk_sized_measured():
    """Peak memory of a training step, measured (peak RSS in a fresh process): chunked stays near its
    inputs, gradients and blocks, dense holds (L, L) matrices; doubling L doubles chunked's peak, not 4x."""
    import json
    import subprocess
    import sys

    def peak(name, L):
        result = subprocess.run([sys.executable, "-c", _PEAK_SCRIPT, name, str(L)], capture_output=True, text=True,
                                check=True)
        measured = json.loads(result.stdout.strip().splitlines()[-1])
        assert measured["error"] is None, measured
        return measured["bytes"]

    L = 2048
    matrix = 2 * L * L * 4  # one (B, H, L, L) float32 matrix: 32 MiB
    chunked, dense_peak = peak("chunked", L), peak("dense", L)
    assert dense_peak >= 2 * matrix, dense_peak  # the measurement sees dense's score and weight matrices
    # chunked: out, grads and a few (B, H, L, D) tensors (1 MiB each) plus (B, H, 256, 256) blocks (0.5 MiB);
    # measured 9.3 MiB, against 32 MiB for one (L, L) matrix and over 64 MiB for dense
    assert chunked <= matrix / 2, (chunked, matrix)
    assert chunked <= dense_peak / 6, (chunked, dense_peak)
    assert peak("chunked", 2 * L) <= 3 * max(chunked, 2**20), "chunked's peak grew faster than linearly in L"
