"""Linear attention: replace softmax(q k^T) by a kernel phi(q) phi(k)^T and reassociate.

Softmax attention weighs key ``j`` for query ``i`` by ``exp(q_i . k_j)``. Linear attention
(Katharopoulos et al. 2020, "Transformers are RNNs") uses a feature map ``phi`` with
non-negative outputs instead, ``sim(q_i, k_j) = phi(q_i) . phi(k_j)``, so that

    out_i = sum_j sim(q_i, k_j) v_j / sum_j sim(q_i, k_j)
          = phi(q_i)^T (sum_j phi(k_j) v_j^T) / (phi(q_i)^T sum_j phi(k_j))

The bracketed sums ``S = sum_j phi(k_j) v_j^T`` ``(M, Dv)`` and ``z = sum_j phi(k_j)`` ``(M,)``
do not depend on ``i``: computing them first (associativity of the matrix product) costs
``O(N M Dv)`` instead of ``O(N^2)``.

* Non-causal: one ``S`` and one ``z`` for the whole sequence, summed over chunks of keys, then
  applied to chunks of queries. The chunks change no maths; they keep every temporary small
  (``O(chunk M)``), which on a CPU also keeps long sequences from paying a page fault per byte
  for each fresh 32 MB temporary (measured: twice as fast at N = 16384, ``attn-course bench attention``).
* Causal: query ``t`` reads only keys ``0..t``: ``S_t = sum_{j<=t} phi(k_j) v_j^T`` and ``z_t``.
  Three ways to compute it, chosen by ``method`` (all equal up to rounding):

  - ``"chunkwise"`` (the default; the causal form of Katharopoulos et al. 2020 computed a chunk at
    a time, as Hua et al. 2022 (FLASH) and later linear-attention kernels do): split
    the sequence into chunks of ``C`` positions. Within a chunk, the masked quadratic form
    ``tril(phi(Q_c) phi(K_c)^T) V_c`` -- one ``(C, C)`` matmul; across chunks, one running
    ``(M, Dv)`` state ``S`` and normaliser ``z`` (the RNN state, advanced a chunk at a time:
    ``S <- S + phi(K_c)^T V_c``), which the chunk's queries read as ``phi(Q_c) S``. Every step is
    a matrix product, so the time is matmul-bound and linear in ``N`` (``attn-course bench peers``
    measured 17.8x from N = 1024 to 16384, 2 threads).
  - ``"prefix_sum"``: the literal definition, ``cumsum`` of the ``(C, M, Dv)`` outer products
    ``phi(k_j) v_j^T`` chunk by chunk. It reads and writes ``M Dv`` numbers per position, which
    makes it memory-bound: lesson 06 measures it against ``"chunkwise"`` (15x slower at N = 2048,
    B = 1, H = 2, D = 64, float32, one thread, on the 2-core development machine).
  - ``"rnn"``: one token at a time, exactly :func:`linear_attention_step` in a loop -- an RNN
    whose state is ``(S_t, z_t)``. For teaching and for checking; :func:`linear_attention_step`
    is the one to decode with, in constant memory per token.
* :func:`linear_attention_quadratic` computes the same numbers the ``O(N^2)`` way
  (``phi(Q) phi(K)^T`` then normalise); lessons and tests use it to check the fast forms.

Feature maps: ``"elu"`` (``elu(x) + 1``, the paper's choice), ``"relu"``, or a callable such
as :class:`RandomFeatureMap` (Performer's FAVOR+ positive random features, Choromanski et
al. 2021, which approximate the softmax kernel itself).

``eps`` (default ``1e-6``, the value and the place used by the source article and the
paper's code) is added to the denominator: ``out = num / (den + eps)``. It keeps a row
finite when ``den`` is 0 -- ``elu(x) + 1`` is exactly 0 in float32 for ``x`` below about
-17 (-16.6 to -17.3, depending on the kernel that computes it), ReLU features are 0 for any
negative input, and a fully padded row has no keys -- and then the output row is 0. float16 / bfloat16 inputs are computed and accumulated in
float32 (a sum of 16k features of size ~5 already exceeds float16's 65504), then cast back.

Shapes: q ``(..., L, D)``, k ``(..., S, D)``, v ``(..., S, Dv)`` -> ``(..., L, Dv)``; features
``(..., N, M)``. ``mask`` is a key-padding mask, bool, True = real token, broadcastable to
``(..., 1, S)`` (``padding_mask(lengths)[:, None, None, :]``).

Taught in lesson 06 (linear attention).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from ._checks import broadcast_shapes, check_key_mask, check_positive_int, check_qkv, check_tensor, shape_str

__all__ = [
    "elu_feature_map",
    "relu_feature_map",
    "RandomFeatureMap",
    "linear_attention",
    "linear_attention_quadratic",
    "LinearAttentionState",
    "linear_attention_step",
    "CAUSAL_METHODS",
]

FeatureMap = Callable[[torch.Tensor], torch.Tensor]


def elu_feature_map(x: torch.Tensor) -> torch.Tensor:
    """``elu(x) + 1``: positive, smooth, and linear (``x + 1``) for ``x > 0`` (Katharopoulos et al. 2020)."""
    return F.elu(x) + 1


def relu_feature_map(x: torch.Tensor) -> torch.Tensor:
    """``relu(x)``: non-negative but exactly 0 for negative inputs (``eps`` then matters)."""
    return F.relu(x)


class RandomFeatureMap(nn.Module):
    """FAVOR+ positive orthogonal random features (Performer, Choromanski et al. 2021).

    ``phi(x) = exp(W x' - |x'|^2 / 2) / sqrt(M)`` with ``x' = x / D^(1/4)`` satisfies
    ``E[phi(q) . phi(k)] = exp(q . k / sqrt(D))``: linear attention with this map
    approximates softmax attention, better as ``num_features`` (M) grows. The rows of the
    ``(M, D)`` projection ``W`` are drawn orthogonal in blocks of D and rescaled to Gaussian
    norms (``orthogonal=True``, FAVOR+'s choice: each row is still Gaussian, so the estimate
    stays unbiased, but within a block the rows cannot point the same way, which lowers its
    variance), or independently Gaussian (``orthogonal=False``, the plain Monte-Carlo estimate
    lesson 06 compares with). Drawn from a seeded generator, so the map is reproducible; it is
    a buffer (moves with ``.to(device)``), not a parameter.
    """

    def __init__(self, head_dim: int, *, num_features: int | None = None, seed: int = 0, orthogonal: bool = True):
        super().__init__()
        self.head_dim = check_positive_int("head_dim", head_dim)
        self.num_features = check_positive_int("num_features", 2 * head_dim if num_features is None else num_features)
        if not isinstance(orthogonal, bool):
            raise TypeError(f"orthogonal must be a bool, got {type(orthogonal).__name__}")
        self.orthogonal = orthogonal
        generator = torch.Generator().manual_seed(seed)
        if not orthogonal:
            gaussian = torch.randn(self.num_features, head_dim, generator=generator, dtype=torch.float64)  # (M, D)
            self.register_buffer("projection", gaussian.float())  # (M, D), rows independent N(0, I)
            return
        blocks = math.ceil(self.num_features / head_dim)
        gaussian = torch.randn(blocks, head_dim, head_dim, generator=generator, dtype=torch.float64)  # (n, D, D)
        orthonormal, upper = torch.linalg.qr(gaussian)  # (n, D, D), orthonormal columns, all blocks in one call
        # Fix the signs (Mezzadri 2006): without this, QR's directions are not uniformly
        # distributed and the kernel estimate stays biased however many features are drawn.
        orthonormal = orthonormal * torch.sign(torch.diagonal(upper, dim1=-2, dim2=-1))[:, None, :]  # (n, D, D)
        rows = orthonormal.transpose(-2, -1)  # (n, D, D), rows orthonormal within a block
        directions = rows.reshape(blocks * head_dim, head_dim)[: self.num_features]  # (M, D)
        norms = torch.randn(self.num_features, head_dim, generator=generator, dtype=torch.float64).norm(dim=-1)  # (M,)
        self.register_buffer("projection", (directions * norms[:, None]).float())  # (M, D), float32 like a parameter

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.head_dim:
            raise ValueError(f"RandomFeatureMap was built for head_dim {self.head_dim}, got input {shape_str(x.shape)}")
        x = x * self.head_dim**-0.25  # (..., N, D)
        projected = torch.matmul(x, self.projection.to(x).T)  # (..., N, M)
        # W x' - |x'|^2 / 2 <= |W_m|^2 / 2, so the exponent is bounded whatever x is.
        return torch.exp(projected - x.pow(2).sum(dim=-1, keepdim=True) / 2) / math.sqrt(self.num_features)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, num_features={self.num_features}, orthogonal={self.orthogonal}"


_NAMED_MAPS: dict[str, FeatureMap] = {"elu": elu_feature_map, "relu": relu_feature_map}


def _resolve_feature_map(feature_map: str | FeatureMap) -> FeatureMap:
    if isinstance(feature_map, str):
        if feature_map not in _NAMED_MAPS:
            raise ValueError(f"feature_map must be one of {sorted(_NAMED_MAPS)} or a callable, got {feature_map!r}")
        return _NAMED_MAPS[feature_map]
    if not callable(feature_map):
        raise TypeError(f"feature_map must be a name or a callable, got {type(feature_map).__name__}")
    return feature_map


def _check_eps(eps: object) -> float:
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        raise TypeError(f"eps must be a float, got {type(eps).__name__}")
    if not eps >= 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    return float(eps)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _feature(feature_map: FeatureMap, x: torch.Tensor) -> torch.Tensor:
    """``phi(x)`` ``(..., N, M)`` for ``x`` ``(..., N, D)``, checked."""
    phi = feature_map(x)
    if not isinstance(phi, torch.Tensor):
        raise TypeError("feature_map must return tensors")
    if phi.dim() != x.dim() or phi.shape[:-1] != x.shape[:-1]:
        raise ValueError(f"feature_map must map (..., N, D) to (..., N, M), got {shape_str(x.shape)} -> {shape_str(phi.shape)}")
    return phi


def _check_feature_sizes(m_q: int, m_k: int) -> None:
    if m_q != m_k:
        raise ValueError(f"feature_map must map (..., N, D) to (..., N, M) with one M, got M = {m_q} for queries and {m_k} for keys")


def _features(feature_map: FeatureMap, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``phi(q)`` ``(..., L, M)`` and ``phi(k)`` ``(..., S, M)``, checked for matching shapes."""
    phi_q, phi_k = _feature(feature_map, q), _feature(feature_map, k)
    _check_feature_sizes(phi_q.shape[-1], phi_k.shape[-1])
    return phi_q, phi_k


def _prepare(q, k, v, mask, *, is_causal):
    L, S, batch_shape = check_qkv(q, k, v)
    if is_causal and L != S:
        raise ValueError(
            f"causal linear attention is for self-attention (query t reads keys 0..t), so q and k need the same "
            f"length: q is {shape_str(q.shape)}, k is {shape_str(k.shape)}"
        )
    if mask is not None:
        mask = check_key_mask(
            mask, batch_shape, L=L, S=S, device=q.device, who="linear attention",
            why="it never forms the (L, S) matrix a per-query mask would act on",
        )  # (..., 1, S)
    return L, S, mask


def _masked_key_features(phi_k: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Zero the features of padding keys: they then add nothing to S or z."""
    if mask is None:
        return phi_k
    keep = mask.transpose(-2, -1)  # (..., S, 1)
    return torch.where(keep, phi_k, torch.zeros_like(phi_k))  # (..., S, M)


CAUSAL_METHODS = ("chunkwise", "prefix_sum", "rnn")

# Chosen by measurement (B = 1, H = 8, D = Dv = M = 64, float32, N = 1024..16384, chunk sizes
# 32..128 timed side by side): see the docstring of linear_attention.
DEFAULT_CAUSAL_CHUNK = 64
_CHUNKS_PER_GROUP = 16  # the chunkwise form's chunks done at once (1024 positions at C = 64)
DEFAULT_PREFIX_SUM_CHUNK = 128
DEFAULT_NONCAUSAL_CHUNK = 512


def linear_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    feature_map: str | FeatureMap = "elu",
    is_causal: bool = False,
    eps: float = 1e-6,
    chunk_size: int | None = None,
    method: str | None = None,
) -> torch.Tensor:
    """Linear attention in ``O(N)``: non-causal by reassociation, causal chunk by chunk.

    Args:
        q, k, v: ``(..., L, D)``, ``(..., S, D)``, ``(..., S, Dv)``.
        mask: optional key-padding mask, bool, True = real token, broadcastable to ``(..., 1, S)``.
        feature_map: ``"elu"``, ``"relu"`` or a callable ``(..., N, D) -> (..., N, M)``.
        is_causal: query ``t`` attends to keys ``0..t`` (needs ``L == S``).
        eps: added to the denominator (see the module docstring).
        chunk_size: positions per chunk. ``"chunkwise"``: the ``(C, C)`` block of the quadratic
            form (default 64); ``"prefix_sum"``: positions per ``cumsum`` (memory
            ``chunk * M * Dv``; default 128); non-causal: keys and queries per pass (default
            512). Not used by ``"rnn"``.
        method: how the causal form is computed: ``"chunkwise"`` (default), ``"prefix_sum"`` or
            ``"rnn"`` (see the module docstring). Only for ``is_causal=True``: the non-causal
            form has one way.

    The default causal chunk, 64, was chosen by timing chunks of 32, 64 and 128 (and 8 to 32 chunks
    per group) side by side, interleaved (B = 1, H = 8, D = Dv = M = 64, float32, one thread,
    N = 1024..16384, 2026-12-02): within a chunk the work is ``2 C (M + Dv)`` FLOPs per position,
    across chunks ``4 M Dv`` (the state's update and its read), so 64 is where the two are equal;
    32 was no faster (its matrix products are too small to run at full speed) and 128 slower at
    every N. The chunks go 16 at a time (1024 positions), whose ``(16, C, C)`` blocks and
    ``(16, M, Dv + 1)`` states are the largest temporaries at any ``N``.
    """
    L, S, mask = _prepare(q, k, v, mask, is_causal=is_causal)
    feature_map = _resolve_feature_map(feature_map)
    eps = _check_eps(eps)
    method = _check_method(method, is_causal=is_causal, chunk_size=chunk_size)
    if chunk_size is None:
        chunk_size = {"chunkwise": DEFAULT_CAUSAL_CHUNK, "prefix_sum": DEFAULT_PREFIX_SUM_CHUNK}.get(
            method, DEFAULT_NONCAUSAL_CHUNK
        )
    chunk_size = check_positive_int("chunk_size", chunk_size)
    out_dtype, compute = q.dtype, _compute_dtype(q.dtype)
    with torch.autocast(device_type=q.device.type, enabled=False):
        q, k, v = q.to(compute), k.to(compute), v.to(compute)
        if is_causal:
            phi_q, phi_k = _features(feature_map, q, k)  # (..., L, M), (..., S, M)
            phi_k = _masked_key_features(phi_k, mask)  # (..., S, M)
            if method == "chunkwise":
                out = _causal_chunkwise(phi_q, phi_k, v, eps=eps, chunk_size=chunk_size)
            elif method == "prefix_sum":
                out = _causal_prefix_sums(phi_q, phi_k, v, eps=eps, chunk_size=chunk_size)
            else:
                out = _causal_recurrent(phi_q, phi_k, v, eps=eps)
        else:
            out = _noncausal_sums(feature_map, q, k, v, mask, eps=eps, chunk_size=chunk_size)
    return out.to(out_dtype)


def _check_method(method: object, *, is_causal: bool, chunk_size: object) -> str | None:
    if method is None:
        return "chunkwise" if is_causal else None
    if not isinstance(method, str) or method not in CAUSAL_METHODS:
        raise ValueError(f"method must be one of {list(CAUSAL_METHODS)} or None, got {method!r}")
    if not is_causal:
        raise ValueError(
            f"method={method!r} chooses how the causal form is computed; the non-causal form has one way "
            "(pass is_causal=True, or leave method=None)"
        )
    if method == "rnn" and chunk_size is not None:
        raise ValueError(f"method='rnn' goes one token at a time and takes no chunk_size, got chunk_size={chunk_size!r}")
    return method


def _noncausal_sums(feature_map, q, k, v, mask, *, eps, chunk_size):
    """``out_i = phi(q_i)^T S / (phi(q_i)^T z + eps)``, with ``S`` and ``z`` summed over key chunks."""
    kv, z = 0.0, 0.0
    for start in range(0, k.shape[-2], chunk_size):
        keys = slice(start, start + chunk_size)
        phi_k = _feature(feature_map, k[..., keys, :])  # (..., C, M)
        phi_k = _masked_key_features(phi_k, None if mask is None else mask[..., keys])  # (..., C, M)
        kv = kv + torch.matmul(phi_k.transpose(-2, -1), v[..., keys, :])  # (..., M, Dv), S = sum_j phi(k_j) v_j^T
        z = z + phi_k.sum(dim=-2, keepdim=True)  # (..., 1, M), z = sum_j phi(k_j)
    outputs = []
    for start in range(0, q.shape[-2], chunk_size):
        phi_q = _feature(feature_map, q[..., start : start + chunk_size, :])  # (..., C, M)
        _check_feature_sizes(phi_q.shape[-1], kv.shape[-2])
        numerator = torch.matmul(phi_q, kv)  # (..., C, Dv)
        denominator = torch.matmul(phi_q, z.transpose(-2, -1))  # (..., C, 1)
        outputs.append(numerator / (denominator + eps))  # (..., C, Dv)
    return torch.cat(outputs, dim=-2)  # (..., L, Dv)


def _causal_chunkwise(phi_q, phi_k, v, *, eps, chunk_size):
    """Chunk by chunk: the masked quadratic form inside a chunk, the running state ``(S, z)`` across chunks.

    For the queries of chunk ``c`` (positions ``t`` in ``[cC, (c+1)C)``)::

        numerator_t   = sum_{j in chunk c, j <= t} (phi(q_t) . phi(k_j)) v_j  +  phi(q_t)^T S_{c-1}
        denominator_t = sum_{j in chunk c, j <= t}  phi(q_t) . phi(k_j)       +  phi(q_t)^T z_{c-1}

    with the RNN state after chunk ``c``: ``S_c = S_{c-1} + phi(K_c)^T V_c`` ``(M, Dv)`` and
    ``z_c = z_{c-1} + sum_{j in chunk c} phi(k_j)`` ``(M,)``, ``S_{-1} = 0``, ``z_{-1} = 0``.

    Two details make it fast without changing the maths:

    * The denominator is the numerator of a value that is 1 everywhere, so ``v`` gets a column of
      ones: ``[V | 1]`` ``(..., N, Dv + 1)``. One matrix product then gives both, and the state is
      ``[S | z]`` ``(M, Dv + 1)``: no separate pass for the sums.
    * The chunks go ``_CHUNKS_PER_GROUP`` at a time. Within a group every chunk is done at once: the
      ``(C, C)`` blocks are one batched matmul and the recurrence over the group's chunks is a
      ``cumsum`` of their ``phi(K_c)^T [V_c | 1]``, started from the state the previous group left.
      The temporaries are then a group's size whatever ``N`` (a fresh 32 MB temporary costs a page
      fault per 4 KB on a CPU), and the time stays linear in ``N``. A Python loop over single chunks
      (the same maths, exercise 06's stretch task) launches about ten small kernels per chunk:
      several times slower below N = 4096.
    """
    length, value_dim = phi_q.shape[-2], v.shape[-1]
    chunk = min(chunk_size, length)
    group = chunk * _CHUNKS_PER_GROUP  # positions per group
    ones = v.new_ones(*v.shape[:-1], 1)  # (..., N, 1)
    state = v.new_zeros(*phi_k.shape[:-2], phi_k.shape[-1], value_dim + 1)  # (..., M, Dv + 1), [S | z] so far
    outputs = []
    for start in range(0, length, group):
        stop = min(start + group, length)
        group_q, group_k = phi_q[..., start:stop, :], phi_k[..., start:stop, :]  # (..., G, M)
        group_v = torch.cat([v[..., start:stop, :], ones[..., start:stop, :]], dim=-1)  # (..., G, Dv + 1), [V | 1]
        padding = -(stop - start) % chunk
        if padding:  # zero keys after the last query are never read (causal); the extra query rows are cut below
            group_q, group_k, group_v = (F.pad(x, (0, 0, 0, padding)) for x in (group_q, group_k, group_v))
        n = group_q.shape[-2] // chunk
        chunk_q = group_q.unflatten(-2, (n, chunk))  # (..., n, C, M)
        chunk_k = group_k.unflatten(-2, (n, chunk))  # (..., n, C, M)
        chunk_v = group_v.unflatten(-2, (n, chunk))  # (..., n, C, Dv + 1)
        # Within each chunk: the masked quadratic form, one (C, C) matmul per chunk.
        scores = torch.matmul(chunk_q, chunk_k.transpose(-2, -1)).tril_()  # (..., n, C, C), keys j <= t
        out = torch.matmul(scores, chunk_v)  # (..., n, C, Dv + 1), [numerator | denominator] within the chunk
        # Across chunks: [S_c | z_c] = [S_{c-1} | z_{c-1}] + phi(K_c)^T [V_c | 1], started from the previous group's.
        updates = torch.matmul(chunk_k.transpose(-2, -1), chunk_v)  # (..., n, M, Dv + 1)
        before = torch.cat([state.unsqueeze(-3), updates[..., :-1, :, :]], dim=-3).cumsum(dim=-3)  # (..., n, M, Dv + 1)
        out = out + torch.matmul(chunk_q, before)  # (..., n, C, Dv + 1), plus what the earlier chunks left
        state = before[..., -1, :, :] + updates[..., -1, :, :]  # (..., M, Dv + 1), after this group
        out = out.flatten(-3, -2)[..., : stop - start, :]  # (..., G, Dv + 1)
        outputs.append(out[..., :value_dim] / (out[..., value_dim:] + eps))  # (..., G, Dv)
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=-2)  # (..., L, Dv)


def _causal_prefix_sums(phi_q, phi_k, v, *, eps, chunk_size):
    """``out_t = phi(q_t)^T S_t / (phi(q_t)^T z_t + eps)`` with ``S_t``, ``z_t`` from ``cumsum``."""
    batch_shape = broadcast_shapes(phi_q.shape[:-2], phi_k.shape[:-2], v.shape[:-2])
    length, features, value_dim = phi_q.shape[-2], phi_q.shape[-1], v.shape[-1]
    state_kv = phi_q.new_zeros(*batch_shape, 1, features, value_dim)  # (..., 1, M, Dv), sums before this chunk
    state_z = phi_q.new_zeros(*batch_shape, 1, features)  # (..., 1, M)
    outputs = []
    for start in range(0, length, chunk_size):
        stop = min(start + chunk_size, length)
        chunk_q, chunk_k = phi_q[..., start:stop, :], phi_k[..., start:stop, :]  # (..., C, M)
        outer = chunk_k[..., :, :, None] * v[..., start:stop, None, :]  # (..., C, M, Dv), phi(k_j) v_j^T
        prefix_kv = state_kv + outer.cumsum(dim=-3)  # (..., C, M, Dv), S_t
        prefix_z = state_z + chunk_k.cumsum(dim=-2)  # (..., C, M), z_t
        numerator = torch.matmul(chunk_q[..., :, None, :], prefix_kv)[..., 0, :]  # (..., C, Dv)
        denominator = (chunk_q * prefix_z).sum(dim=-1, keepdim=True)  # (..., C, 1)
        outputs.append(numerator / (denominator + eps))  # (..., C, Dv)
        state_kv, state_z = prefix_kv[..., -1:, :, :], prefix_z[..., -1:, :]  # carry S_t, z_t of the last position
    return torch.cat(outputs, dim=-2)  # (..., L, Dv)


def _causal_recurrent(phi_q, phi_k, v, *, eps):
    """One token at a time, the RNN: ``S_t = S_{t-1} + phi(k_t) v_t^T``, ``z_t = z_{t-1} + phi(k_t)``."""
    batch_shape = broadcast_shapes(phi_q.shape[:-2], phi_k.shape[:-2], v.shape[:-2])
    state_kv = phi_q.new_zeros(*batch_shape, phi_q.shape[-1], v.shape[-1])  # (..., M, Dv)
    state_z = phi_q.new_zeros(*batch_shape, phi_q.shape[-1])  # (..., M)
    outputs = []
    for t in range(phi_q.shape[-2]):
        out, state_kv, state_z = _step(phi_q[..., t, :], phi_k[..., t, :], v[..., t, :], state_kv, state_z, eps=eps)
        outputs.append(out)  # (..., Dv)
    return torch.stack(outputs, dim=-2)  # (..., L, Dv)


def _step(phi_q, phi_k, v, state_kv, state_z, *, eps):
    """Add token ``t`` to the state, read out position ``t``: features ``(..., M)``, ``v`` ``(..., Dv)``."""
    state_kv = state_kv + phi_k[..., :, None] * v[..., None, :]  # (..., M, Dv), S_t = S_{t-1} + phi(k_t) v_t^T
    state_z = state_z + phi_k  # (..., M), z_t = z_{t-1} + phi(k_t)
    numerator = torch.matmul(phi_q[..., None, :], state_kv)[..., 0, :]  # (..., Dv)
    denominator = (phi_q * state_z).sum(dim=-1, keepdim=True)  # (..., 1)
    return numerator / (denominator + eps), state_kv, state_z


def linear_attention_quadratic(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    feature_map: str | FeatureMap = "elu",
    is_causal: bool = False,
    eps: float = 1e-6,
) -> torch.Tensor:
    """The same attention the ``O(N^2)`` way: ``A = phi(Q) phi(K)^T``, masked, ``A V / (rowsum(A) + eps)``.

    Equal to :func:`linear_attention` up to rounding. For lessons and tests, not for speed.
    """
    L, S, mask = _prepare(q, k, v, mask, is_causal=is_causal)
    feature_map = _resolve_feature_map(feature_map)
    eps = _check_eps(eps)
    compute = _compute_dtype(q.dtype)
    with torch.autocast(device_type=q.device.type, enabled=False):
        phi_q, phi_k = _features(feature_map, q.to(compute), k.to(compute))  # (..., L, M), (..., S, M)
        similarity = torch.matmul(phi_q, phi_k.transpose(-2, -1))  # (..., L, S)
        if mask is not None:
            similarity = torch.where(mask, similarity, torch.zeros_like(similarity))  # (..., L, S)
        if is_causal:
            similarity = torch.tril(similarity)  # (..., L, S), keys j <= i only
        out = torch.matmul(similarity, v.to(compute)) / (similarity.sum(dim=-1, keepdim=True) + eps)  # (..., L, Dv)
    return out.to(q.dtype)


class LinearAttentionState(NamedTuple):
    """The recurrent state after ``t`` tokens: ``kv = S_t`` ``(..., M, Dv)`` and ``z = z_t`` ``(..., M)``."""

    kv: torch.Tensor
    z: torch.Tensor


def linear_attention_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    state: LinearAttentionState | None = None,
    *,
    feature_map: str | FeatureMap = "elu",
    eps: float = 1e-6,
) -> tuple[torch.Tensor, LinearAttentionState]:
    """One step of causal linear attention as an RNN: add token ``t``, read out position ``t``.

    ``S_t = S_{t-1} + phi(k_t) v_t^T``, ``z_t = z_{t-1} + phi(k_t)``,
    ``out_t = phi(q_t)^T S_t / (phi(q_t)^T z_t + eps)``. Constant time and memory per token,
    whatever ``t`` is. Running it over ``t = 0..L-1`` gives ``linear_attention(...,
    is_causal=True)``.

    Args:
        q, k: ``(..., D)`` the current token's query and key; v: ``(..., Dv)``.
        state: the state after the previous tokens, or ``None`` at the first token.

    Returns:
        ``(out_t, new_state)`` with ``out_t`` ``(..., Dv)``. The state is kept in float32 for
        float16 / bfloat16 inputs.
    """
    for name, x in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, x, min_dim=1)
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q and k must have the same last dim D, got q {shape_str(q.shape)} and k {shape_str(k.shape)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k and v must share one dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}")
    feature_map = _resolve_feature_map(feature_map)
    eps = _check_eps(eps)
    compute = _compute_dtype(q.dtype)
    with torch.autocast(device_type=q.device.type, enabled=False):
        phi_q, phi_k = _features(feature_map, q.to(compute)[..., None, :], k.to(compute)[..., None, :])  # (..., 1, M)
        phi_q, phi_k = phi_q[..., 0, :], phi_k[..., 0, :]  # (..., M)
        v = v.to(compute)
        if state is None:
            kv = phi_q.new_zeros(*broadcast_shapes(phi_k.shape[:-1], v.shape[:-1]), phi_k.shape[-1], v.shape[-1])
            z = torch.zeros_like(phi_k)
        else:
            if not isinstance(state, LinearAttentionState):
                raise TypeError(f"state must be a LinearAttentionState or None, got {type(state).__name__}")
            expected = (phi_k.shape[-1], v.shape[-1])
            if tuple(state.kv.shape[-2:]) != expected:
                raise ValueError(
                    f"state.kv is (..., M, Dv) = {shape_str(state.kv.shape)} but this token gives "
                    f"{shape_str((*phi_k.shape[:-1], *expected))}: was the state made with another feature map or value size?"
                )
            kv, z = state.kv, state.z  # (..., M, Dv), (..., M)
        out, kv, z = _step(phi_q, phi_k, v, kv, z, eps=eps)  # (..., Dv), the state after token t
    return out.to(q.dtype), LinearAttentionState(kv, z)
