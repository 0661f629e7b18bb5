"""Linear attention: O(N) forms against the quadratic kernel form, causal = prefix sums = RNN, stability."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import attn_course as ac
import attn_course.linear as linear_module
from attn_course.measure import largest_tensor_bytes
from attn_course.linear import (
    CAUSAL_METHODS,
    LinearAttentionState,
    RandomFeatureMap,
    elu_feature_map,
    linear_attention,
    linear_attention_quadratic,
    linear_attention_step,
    relu_feature_map,
)

F64 = {"atol": 1e-10, "rtol": 1e-10}
FEATURE_MAPS = {
    "elu": "elu",
    "relu": "relu",
    "favor": RandomFeatureMap(8, num_features=16, seed=1),
}


def qkv(gen, L, S=None, *, D=8, Dv=5, batch=(2, 3), grad=False, dtype=torch.float64):
    S = L if S is None else S
    return tuple(
        torch.randn(*batch, n, d, generator=gen, dtype=dtype).requires_grad_(grad) for n, d in ((L, D), (S, D), (S, Dv))
    )


def kernel_oracle(q, k, v, allowed, phi, eps=1e-6):
    """Written out independently: out_i = sum_j a_ij v_j / (sum_j a_ij + eps), a_ij = phi(q_i).phi(k_j) if allowed."""
    a = torch.einsum("...im,...jm->...ij", phi(q), phi(k))  # (..., L, S)
    a = a * allowed
    return torch.einsum("...ij,...jd->...id", a, v) / (a.sum(-1, keepdim=True) + eps)


def run_recurrent(q, k, v, feature_map, eps=1e-6):
    state, outputs = None, []
    for t in range(q.shape[-2]):
        out, state = linear_attention_step(q[..., t, :], k[..., t, :], v[..., t, :], state, feature_map=feature_map, eps=eps)
        outputs.append(out)
    return torch.stack(outputs, dim=-2), state


@pytest.mark.parametrize("chunk_size", [None, 1, 5], ids=["one-chunk", "chunk1", "chunk5"])
@pytest.mark.parametrize("with_mask", [False, True], ids=["nomask", "padding"])
@pytest.mark.parametrize("name", FEATURE_MAPS)
def test_non_causal_equals_quadratic_form(gen, name, with_mask, chunk_size):
    q, k, v = qkv(gen, 17, 23, grad=True)
    mask = ac.padding_mask([23, 9])[:, None, None, :] if with_mask else None  # (B, 1, 1, S)
    fmap = FEATURE_MAPS[name]
    got = linear_attention(q, k, v, mask, feature_map=fmap, chunk_size=chunk_size)
    expected = linear_attention_quadratic(q, k, v, mask, feature_map=fmap)
    torch.testing.assert_close(got, expected, **F64)
    grads = torch.autograd.grad(got.sum(), (q, k, v))
    for g, e in zip(grads, torch.autograd.grad(expected.sum(), (q, k, v))):
        torch.testing.assert_close(g, e, **F64)


def test_quadratic_form_matches_an_independent_oracle(gen):
    q, k, v = qkv(gen, 12)
    pad = ac.padding_mask([12, 7])[:, None, None, :]
    allowed = pad & ac.causal_mask(12)  # (B, 1, L, S)
    expected = kernel_oracle(q, k, v, allowed, lambda x: F.elu(x) + 1)
    torch.testing.assert_close(linear_attention_quadratic(q, k, v, pad, is_causal=True), expected, **F64)
    torch.testing.assert_close(linear_attention(q, k, v, pad, is_causal=True, chunk_size=5), expected, **F64)


@pytest.mark.parametrize("chunk_size", [1, 7, 128])
@pytest.mark.parametrize("method", ["chunkwise", "prefix_sum"])
@pytest.mark.parametrize("name", FEATURE_MAPS)
def test_causal_forms_equal_masked_quadratic_equal_recurrent(gen, name, method, chunk_size):
    q, k, v = qkv(gen, 30, grad=True)
    fmap = FEATURE_MAPS[name]
    fast = linear_attention(q, k, v, feature_map=fmap, is_causal=True, chunk_size=chunk_size, method=method)
    quadratic = linear_attention_quadratic(q, k, v, feature_map=fmap, is_causal=True)
    recurrent, state = run_recurrent(q, k, v, fmap)
    torch.testing.assert_close(fast, quadratic, **F64)
    torch.testing.assert_close(recurrent, quadratic, **F64)
    assert isinstance(state, LinearAttentionState) and state.kv.shape[-2:] == (q.shape[-1] * (2 if name == "favor" else 1), 5)
    for g, e in zip(torch.autograd.grad(fast.sum(), (q, k, v)), torch.autograd.grad(quadratic.sum(), (q, k, v))):
        torch.testing.assert_close(g, e, **F64)


@pytest.mark.parametrize(
    "L,chunk_size",
    [(1, None), (1, 4), (5, None), (64, None), (65, None), (130, None), (33, 8), (32, 8), (9, 10),
     (128, 4), (131, 4), (1100, None)],
    ids=["L1", "L1-chunk4", "shorter-than-a-chunk", "one-chunk", "one-past", "two-and-a-bit", "ragged", "exact", "chunk>L",
         "two-groups", "groups-ragged", "default-groups"],
)
@pytest.mark.parametrize("with_mask", [False, True], ids=["nomask", "padding"])
@pytest.mark.parametrize("name", FEATURE_MAPS)
def test_every_causal_method_is_exact_at_any_length(gen, name, with_mask, L, chunk_size):
    """chunkwise (default), prefix sums and the RNN against the masked quadratic form: float64, gradients, padding."""
    q, k, v = qkv(gen, L, grad=True)
    mask = ac.padding_mask([L, max(L // 2, 1)])[:, None, None, :] if with_mask else None  # (B, 1, 1, S)
    fmap = FEATURE_MAPS[name]
    expected = linear_attention_quadratic(q, k, v, mask, feature_map=fmap, is_causal=True)
    expected_grads = torch.autograd.grad((expected * torch.linspace(-1, 1, expected.shape[-1], dtype=torch.float64)).sum(), (q, k, v))
    for method in (None, *CAUSAL_METHODS):
        size = None if method == "rnn" else chunk_size
        got = linear_attention(q, k, v, mask, feature_map=fmap, is_causal=True, chunk_size=size, method=method)
        torch.testing.assert_close(got, expected, **F64, msg=lambda m, method=method: f"method={method}: {m}")
        grads = torch.autograd.grad((got * torch.linspace(-1, 1, got.shape[-1], dtype=torch.float64)).sum(), (q, k, v))
        for g, e in zip(grads, expected_grads):
            torch.testing.assert_close(g, e, **F64)


def test_chunkwise_is_the_default_causal_form(gen, monkeypatch):
    """A probe on the three paths, and the memory each allocates: the default really is chunkwise."""
    calls = []
    for name in ("_causal_chunkwise", "_causal_prefix_sums", "_causal_recurrent"):
        original = getattr(linear_module, name)
        monkeypatch.setattr(linear_module, name, lambda *a, _f=original, _n=name, **kw: calls.append(_n) or _f(*a, **kw))
    q, k, v = qkv(gen, 40, batch=(1,))
    linear_attention(q, k, v, is_causal=True)
    linear_attention(q, k, v)  # non-causal: none of the three
    assert calls == ["_causal_chunkwise"]
    for method, path in (("chunkwise", "_causal_chunkwise"), ("prefix_sum", "_causal_prefix_sums"), ("rnn", "_causal_recurrent")):
        calls.clear()
        linear_attention(q, k, v, is_causal=True, method=method)
        assert calls == [path]
    monkeypatch.undo()
    # The prefix-sum path forms (chunk, M, Dv) outer products; the chunkwise one only (C, C) blocks and (M, Dv) states.
    q, k, v = qkv(gen, 1024, D=64, Dv=64, batch=(1, 2))  # (128, 64, 64) outer products vs (L / 128, 128, 128) blocks
    default = largest_tensor_bytes(linear_attention, q, k, v, is_causal=True)
    prefix = largest_tensor_bytes(linear_attention, q, k, v, is_causal=True, method="prefix_sum")
    assert default == largest_tensor_bytes(linear_attention, q, k, v, is_causal=True, method="chunkwise")
    assert default <= prefix / 4, (default, prefix)


def test_chunkwise_memory_and_kernel_count_grow_as_promised(gen):
    """O(N) memory (no (N, N) block), and kernels per group of chunks, not per chunk (no Python loop over chunks)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from attn_course.linear import _CHUNKS_PER_GROUP

    class CountOps(TorchDispatchMode):
        """Counts every kernel, and the matrix products apart."""

        def __init__(self):
            super().__init__()
            self.count = self.products = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.count += 1
            self.products += func.overloadpacket in (torch.ops.aten.bmm, torch.ops.aten.mm)
            return func(*args, **(kwargs or {}))

    chunk = 32
    group = chunk * _CHUNKS_PER_GROUP
    sizes, counts = [], []
    for groups in (2, 3, 4):
        q, k, v = qkv(gen, groups * group, D=16, Dv=16, batch=(1, 2))
        sizes.append(largest_tensor_bytes(linear_attention, q, k, v, is_causal=True, chunk_size=chunk))
        with CountOps() as mode:
            linear_attention(q, k, v, is_causal=True, chunk_size=chunk)
        counts.append(mode.count)
        # Four batched products per group of chunks (the in-chunk scores and their values, the state's update
        # and its read): a loop over chunks would make four per chunk.
        assert mode.products == 4 * groups, (groups, mode.products)
    assert sizes[2] <= 2 * sizes[0] * 1.01, sizes  # 2x the length, at most 2x the largest tensor (quadratic: 4x)
    assert counts[2] - counts[1] == counts[1] - counts[0], counts  # the same kernels for every further group
    with CountOps() as mode:
        linear_attention(q, k, v, is_causal=True, method="prefix_sum", chunk_size=chunk)
    assert mode.count > 4 * counts[2]  # the teaching path loops over chunks in Python


def test_causal_output_at_t_ignores_the_future(gen):
    q, k, v = qkv(gen, 40)
    out = linear_attention(q, k, v, is_causal=True, chunk_size=16)
    t = 21
    changed = [x.clone() for x in (q, k, v)]
    for x in changed:
        x[..., t + 1 :, :] = torch.randn(x[..., t + 1 :, :].shape, generator=gen, dtype=x.dtype) * 5
    out_changed = linear_attention(*changed, is_causal=True, chunk_size=16)
    torch.testing.assert_close(out_changed[..., : t + 1, :], out[..., : t + 1, :], **F64)
    assert not torch.allclose(out_changed[..., t + 1 :, :], out[..., t + 1 :, :])  # the future did change


def test_padding_keys_change_nothing(gen):
    """Masked keys' values are never read, and the result equals running on the unpadded sequence."""
    q, k, v = qkv(gen, 10, 14)
    pad = ac.padding_mask([14, 9])[:, None, None, :]
    out = linear_attention(q, k, v, pad)
    k2, v2 = k.clone(), v.clone()
    k2[1, ..., 9:, :], v2[1, ..., 9:, :] = 100.0, -100.0
    torch.testing.assert_close(linear_attention(q, k2, v2, pad), out, **F64)
    torch.testing.assert_close(out[1], linear_attention(q[1], k[1, :, :9], v[1, :, :9]), **F64)


def test_eps_sits_in_the_denominator(gen):
    q, k, v = qkv(gen, 6, batch=(1,))
    phi_q, phi_k = elu_feature_map(q), elu_feature_map(k)
    manual = (phi_q @ (phi_k.transpose(-2, -1) @ v)) / (phi_q @ phi_k.sum(-2, keepdim=True).transpose(-2, -1) + 0.5)
    torch.testing.assert_close(linear_attention(q, k, v, eps=0.5), manual, **F64)


def test_zero_features_give_zero_rows_not_nan(gen):
    """ReLU features of all-negative queries are 0, and a fully padded sequence has no keys: eps keeps rows finite."""
    q, k, v = qkv(gen, 8)
    q = -q.abs() - 0.1
    for is_causal in (False, True):
        out = linear_attention(q, k, v, feature_map="relu", is_causal=is_causal)
        assert torch.equal(out, torch.zeros_like(out))
    empty = torch.zeros(2, 1, 1, 8, dtype=torch.bool)
    out = linear_attention(q.abs(), k, v, empty)
    assert torch.equal(out, torch.zeros_like(out))
    # the failure eps prevents: 0 / 0 without it
    assert torch.isnan(linear_attention(q, k, v, feature_map="relu", eps=0.0)).all()


@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_long_low_precision_sequences_stay_finite(gen, dtype, is_causal):
    """16k keys whose elu+1 features are about 5: their sum (~80000) overflows float16 unless accumulated in float32."""
    L = 16384
    q, k, v = qkv(gen, L, D=16, Dv=16, batch=(1, 1), dtype=torch.float32)
    k = k + 4
    expected = linear_attention(q.double(), k.double(), v.double(), is_causal=is_causal)
    got = linear_attention(q.to(dtype), k.to(dtype), v.to(dtype), is_causal=is_causal, chunk_size=512)
    assert got.dtype == dtype and torch.isfinite(got).all()
    # Within one rounding step of the output's dtype at its largest value: |error| <= eps * max|out|.
    # Measured |error| / (eps * max|out|): 0.21 fp16 causal, 0.24 bf16 causal, 0.42 bf16 full (largest
    # outputs 1.64 causal, 0.028 full). Was atol = rtol = 0.02, i.e. 0.7x the whole output in the full case.
    tol = torch.finfo(dtype).eps * expected.abs().max().item()
    torch.testing.assert_close(got.double(), expected, atol=tol, rtol=0)
    assert (k.to(dtype).float() + 1).sum(dim=-2).max() > torch.finfo(torch.float16).max  # the sum really is that big


def test_under_autocast_matches_float32(gen):
    q, k, v = qkv(gen, 50, dtype=torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = linear_attention(q, k, v, is_causal=True)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, linear_attention(q, k, v, is_causal=True), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_gradcheck(gen, is_causal):
    q, k, v = qkv(gen, 6, D=3, Dv=2, batch=(2,), grad=True)
    pad = ac.padding_mask([6, 4])[:, None, :]  # (B, 1, S)
    assert torch.autograd.gradcheck(
        lambda q, k, v: linear_attention(q, k, v, pad, is_causal=is_causal, chunk_size=4), (q, k, v)
    )


def test_random_features_approximate_softmax_attention(gen):
    """FAVOR+: E[phi(q).phi(k)] = exp(q.k / sqrt(D)); more features, closer to softmax attention."""
    q, k, v = qkv(gen, 20, D=8, batch=(2,))
    q, k = q * 0.5, k * 0.5  # moderate logits: the estimator's variance grows like exp(|q + k|^2)
    softmax = ac.scaled_dot_product_attention(q, k, v)
    errors = [
        (linear_attention(q, k, v, feature_map=RandomFeatureMap(8, num_features=m, seed=0)) - softmax).abs().mean()
        for m in (8, 4096)
    ]
    assert errors[1] < 0.05 and errors[1] < errors[0] / 4, errors
    kernel = RandomFeatureMap(8, num_features=20000, seed=2)
    estimate = kernel(q[0]) @ kernel(k[0]).T  # (L, S)
    torch.testing.assert_close(estimate, torch.exp(q[0] @ k[0].T / math.sqrt(8)), rtol=0.15, atol=0)


def test_random_feature_map_is_seeded_and_moves_with_the_module():
    a, b, c = (RandomFeatureMap(4, num_features=10, seed=s) for s in (0, 0, 1))
    assert torch.equal(a.projection, b.projection) and not torch.equal(a.projection, c.projection)
    assert a.projection.shape == (10, 4) and "projection" in a.state_dict() and not list(a.parameters())
    rows = a.projection[:4] / a.projection[:4].norm(dim=-1, keepdim=True)
    torch.testing.assert_close(rows @ rows.T, torch.eye(4), atol=1e-5, rtol=0)  # orthogonal within a block
    assert a.double().projection.dtype == torch.float64
    with pytest.raises(ValueError, match=r"built for head_dim 4, got input \(3, 5\)"):
        a(torch.randn(3, 5))


def test_iid_random_features_are_unbiased_too_and_orthogonal_ones_vary_less(gen):
    """orthogonal=False draws the rows independently: the same expectation, a larger variance.

    300 seeds of M = D = 8 features at 20 x 20 pairs with logits of std ~0.1: both means are within
    5% of exp(q.k / sqrt(D)) on average (measured 0.9% and 1.0%); the orthogonal estimate's mean
    squared error is 0.87 of the iid one's (0.69-0.87 over four input seeds; the estimator's heavy
    tail makes it noisier for larger logits, which is why lesson 06 averages attention distances).
    """
    q, k = (0.3 * torch.randn(20, 8, generator=gen, dtype=torch.float64) for _ in range(2))  # (L, D), (S, D)
    exact = torch.exp(q @ k.T / math.sqrt(8))  # (L, S)
    squared_error = {}
    for orthogonal in (True, False):
        maps = [RandomFeatureMap(8, num_features=8, seed=s, orthogonal=orthogonal).double() for s in range(300)]
        found = torch.stack([m(q) @ m(k).T for m in maps])  # (seeds, L, S)
        assert ((found.mean(0) - exact).abs() / exact).mean() < 0.05
        squared_error[orthogonal] = ((found - exact) ** 2).mean().item()
    assert squared_error[True] < 0.95 * squared_error[False], squared_error
    iid = RandomFeatureMap(4, num_features=10, seed=0, orthogonal=False)
    rows = iid.projection[:4] / iid.projection[:4].norm(dim=-1, keepdim=True)
    assert (rows @ rows.T - torch.eye(4)).abs().max() > 0.1  # not orthogonal
    assert "orthogonal=False" in repr(iid)
    with pytest.raises(TypeError, match="orthogonal must be a bool"):
        RandomFeatureMap(4, orthogonal="yes")


def test_relu_feature_map_is_relu():
    x = torch.tensor([-2.0, 0.0, 3.0])
    assert relu_feature_map(x).tolist() == [0.0, 0.0, 3.0]
    assert elu_feature_map(torch.tensor([-30.0])).item() == 0.0  # why eps is needed (float32)


def test_never_forms_an_l_by_s_matrix(gen):
    q, k, v = qkv(gen, 1024, D=16, Dv=16, batch=(1, 2))
    full_bytes = 2 * 1024 * 1024 * 8
    assert largest_tensor_bytes(linear_attention_quadratic, q, k, v) >= full_bytes
    assert largest_tensor_bytes(linear_attention, q, k, v) < full_bytes / 8
    assert largest_tensor_bytes(linear_attention, q, k, v, is_causal=True, chunk_size=64) < full_bytes / 8


@settings(max_examples=25, deadline=None)
@given(L=st.integers(1, 25), chunk=st.integers(1, 30), is_causal=st.booleans(), seed=st.integers(0, 2**16))
def test_property_fast_form_equals_quadratic(L, chunk, is_causal, seed):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = qkv(gen, L, batch=(2,))
    pad = torch.rand(2, 1, L, generator=gen) < 0.8
    got = linear_attention(q, k, v, pad, is_causal=is_causal, chunk_size=chunk)
    torch.testing.assert_close(got, linear_attention_quadratic(q, k, v, pad, is_causal=is_causal), **F64)


def test_on_device_matches_cpu(device, gen):
    q, k, v = qkv(gen, 33, dtype=torch.float32)
    fmap = RandomFeatureMap(8, num_features=16, seed=0)
    for is_causal in (False, True):
        expected = linear_attention(q, k, v, feature_map=fmap, is_causal=is_causal)
        got = linear_attention(q.to(device), k.to(device), v.to(device), feature_map=fmap.to(device), is_causal=is_causal)
        torch.testing.assert_close(got.cpu(), expected, atol=1e-5, rtol=1e-5)
    out, state = linear_attention_step(q[..., 0, :].to(device), k[..., 0, :].to(device), v[..., 0, :].to(device))
    assert out.device.type == device.type and state.kv.device.type == device.type


q4, k4, v4 = torch.randn(2, 4, 6, 8), torch.randn(2, 4, 7, 8), torch.randn(2, 4, 7, 8)


@pytest.mark.parametrize(
    "args,kwargs,error,pattern",
    [
        ((q4, k4, v4), {"feature_map": "softmax"}, ValueError, r"feature_map must be one of \['elu', 'relu'\] or a callable, got 'softmax'"),
        ((q4, k4, v4), {"feature_map": 3}, TypeError, r"feature_map must be a name or a callable, got int"),
        ((q4, k4, v4), {"is_causal": True}, ValueError, r"causal linear attention is for self-attention"),
        ((q4, k4, v4, torch.ones(6, 7, dtype=torch.bool)), {}, ValueError, r"key-padding mask of shape \(\.\.\., 1, S\), got \(6, 7\)"),
        ((q4, k4, v4, torch.ones(2, 7, dtype=torch.bool)), {}, ValueError, r"padding mask needs mask\[:, None, None, :\]"),
        ((q4, k4, v4, torch.ones(2, 1, 1, 7)), {}, TypeError, r"boolean key mask.*torch.float32"),
        ((q4, k4, v4), {"eps": -1.0}, ValueError, r"eps must be >= 0, got -1.0"),
        ((q4, k4, v4), {"chunk_size": 0}, ValueError, r"chunk_size must be >= 1, got 0"),
        ((q4, k4, v4), {"method": "scan"}, ValueError, r"method must be one of \['chunkwise', 'prefix_sum', 'rnn'\] or None, got 'scan'"),
        ((q4, k4, v4), {"method": "chunkwise"}, ValueError, r"method='chunkwise' chooses how the causal form is computed"),
        ((k4, k4, v4), {"method": "rnn", "is_causal": True, "chunk_size": 8}, ValueError, r"method='rnn' goes one token at a time and takes no chunk_size"),
        ((q4, k4, v4), {"feature_map": lambda x: x.sum(-1)}, ValueError, r"feature_map must map \(\.\.\., N, D\) to \(\.\.\., N, M\)"),
    ],
    ids=["unknown-map", "bad-map", "causal-L!=S", "full-mask", "BS-mask", "float-mask", "negative-eps", "zero-chunk", "unknown-method", "method-non-causal", "rnn-chunk", "bad-map-shape"],
)
def test_bad_input_errors(args, kwargs, error, pattern):
    with pytest.raises(error, match=pattern):
        linear_attention(*args, **kwargs)


def test_step_rejects_a_mismatched_state():
    _, state = linear_attention_step(torch.randn(2, 8), torch.randn(2, 8), torch.randn(2, 5))
    with pytest.raises(ValueError, match=r"state.kv is \(\.\.\., M, Dv\) = \(2, 8, 5\) but this token gives \(2, 8, 3\)"):
        linear_attention_step(torch.randn(2, 8), torch.randn(2, 8), torch.randn(2, 3), state)
    with pytest.raises(TypeError, match=r"state must be a LinearAttentionState or None, got tuple"):
        linear_attention_step(torch.randn(2, 8), torch.randn(2, 8), torch.randn(2, 5), tuple(state))
    with pytest.raises(ValueError, match=r"same last dim D"):
        linear_attention_step(torch.randn(2, 8), torch.randn(2, 4), torch.randn(2, 5))
