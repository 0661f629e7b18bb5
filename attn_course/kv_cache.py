"""A KV cache for autoregressive decoding with ``MultiHeadAttention`` / ``GroupedQueryAttention``.

A decoder generates one token at a time. Without a cache, step ``t`` re-runs causal
self-attention over all ``t`` tokens: it recomputes every past key and value and every past
output row, only to keep the last one -- O(t^2) work per step. With causal attention the
past rows never change, and a new token only needs

* its own query, key and value (one row each), and
* the keys and values of every earlier token -- which we kept from earlier steps.

So each step projects only the new tokens, appends their keys and values to a preallocated
buffer, and attends from the new queries to everything in the buffer: O(t) work per step.

Causal alignment: the new queries are the LAST ``T`` of ``S`` positions. The right mask
is bottom-right aligned, ``causal_mask(S)[-T:]`` (query ``i`` of the chunk sees keys
``0 .. S - T + i``); PyTorch's ``is_causal`` is top-left aligned and would be wrong here.
A single new token (``T = 1``) may see every cached key, so it needs no mask at all.

Shape legend: B batch, H query heads, Hkv key/value heads (``num_kv_heads``; equal to H for
``MultiHeadAttention``), T new tokens, S cached tokens, D head dim, E model dim.

Taught in lesson 11 (dynamic heads and beyond).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ._checks import check_positive_int, check_tensor, shape_str
from .grouped import GroupedQueryAttention
from .masks import causal_mask, combine_masks
from .multihead import MultiHeadAttention, merge_heads, split_heads

__all__ = ["KVCache", "decode_step", "kv_cache_bytes", "compare_kv_cache_memory"]


class KVCache:
    """Preallocated key and value buffers ``(B, Hkv, max_length, D)`` for one attention layer.

    ``append(k, v)`` copies new keys/values into the next free positions and returns views of
    everything stored so far; nothing is reallocated while decoding. Asking for more than
    ``max_length`` positions raises ``ValueError``. The cache is for inference: use it under
    ``torch.no_grad()`` (each append writes into the buffer in place, which would invalidate
    what autograd saved from earlier steps).
    """

    def __init__(
        self,
        batch_size: int,
        num_kv_heads: int,
        head_dim: int,
        max_length: int,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        self.batch_size = check_positive_int("batch_size", batch_size)
        self.num_kv_heads = check_positive_int("num_kv_heads", num_kv_heads)
        self.head_dim = check_positive_int("head_dim", head_dim)
        self.max_length = check_positive_int("max_length", max_length)
        dtype = torch.get_default_dtype() if dtype is None else dtype
        if not dtype.is_floating_point:
            raise TypeError(f"dtype must be a floating-point dtype, got {dtype}")
        shape = (batch_size, num_kv_heads, max_length, head_dim)
        self.keys = torch.zeros(shape, device=device, dtype=dtype)  # (B, Hkv, max_length, D)
        self.values = torch.zeros(shape, device=device, dtype=dtype)  # (B, Hkv, max_length, D)
        self.length = 0

    @classmethod
    def for_module(cls, module: MultiHeadAttention, *, batch_size: int, max_length: int) -> KVCache:
        """A cache shaped for ``module``: its K/V head count, head dim, device and dtype."""
        if not isinstance(module, MultiHeadAttention):
            raise TypeError(f"for_module expects a MultiHeadAttention, got {type(module).__name__}")
        weight = module.k_proj.weight
        return cls(
            batch_size,
            module.num_kv_heads,
            module.head_dim,
            max_length,
            device=weight.device,
            dtype=weight.dtype,
        )

    def __repr__(self) -> str:
        return (
            f"KVCache(batch_size={self.batch_size}, num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
            f"length={self.length}, max_length={self.max_length}, dtype={self.keys.dtype})"
        )

    @property
    def nbytes(self) -> int:
        """Bytes held by the two preallocated buffers (the whole ``max_length``, used or not)."""
        return self.keys.element_size() * self.keys.numel() * 2

    def reset(self) -> None:
        """Forget every stored position (the buffers are kept and overwritten later)."""
        self.length = 0

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``k``, ``v`` ``(B, Hkv, T, D)``; return all keys and values so far, ``(B, Hkv, S, D)`` views."""
        expected = (self.batch_size, self.num_kv_heads, None, self.head_dim)
        for name, x in (("k", k), ("v", v)):
            check_tensor(name, x, min_dim=4)
            if x.dim() != 4 or (x.shape[0], x.shape[1], x.shape[3]) != (self.batch_size, self.num_kv_heads, self.head_dim):
                raise ValueError(
                    f"{name} must be (B, Hkv, T, D) = ({expected[0]}, {expected[1]}, T, {expected[3]}) for this cache, "
                    f"got shape {shape_str(x.shape)}"
                )
            if x.dtype != self.keys.dtype or x.device != self.keys.device:
                raise TypeError(
                    f"{name} is {x.dtype} on {x.device} but the cache holds {self.keys.dtype} on {self.keys.device}"
                )
        if k.shape[2] != v.shape[2]:
            raise ValueError(
                f"k and v must hold the same number of new positions T: k {shape_str(k.shape)}, v {shape_str(v.shape)}"
            )
        if torch.is_grad_enabled() and (k.requires_grad or v.requires_grad):
            raise RuntimeError(
                "KVCache is for inference: it writes into its buffers in place, which breaks autograd across steps. "
                "Decode under torch.no_grad() (or torch.inference_mode())."
            )
        start, new = self.length, k.shape[2]
        if start + new > self.max_length:
            raise ValueError(
                f"KV cache is full: it holds {start} of max_length={self.max_length} positions and cannot take "
                f"{new} more; create the cache with max_length >= {start + new}"
            )
        self.keys[:, :, start : start + new] = k  # (B, Hkv, T, D) written in place
        self.values[:, :, start : start + new] = v
        self.length = start + new
        return self.keys[:, :, : self.length], self.values[:, :, : self.length]  # (B, Hkv, S, D) views


def decode_step(
    module: MultiHeadAttention, x: torch.Tensor, cache: KVCache, *, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Causal self-attention for ``T`` new tokens ``x`` ``(B, T, E)``, reusing the cached past.

    Projects only the new tokens, appends their keys/values to ``cache`` (which then holds
    ``S`` positions), and attends from the new queries to all ``S`` with a bottom-right
    aligned causal mask (none when ``T = 1``). ``mask`` (bool, True = may attend,
    broadcastable to ``(B, H, T, S)``, e.g. a padding mask ``(B, 1, 1, S)``) is combined with
    it. Feeding a sequence in pieces gives exactly ``module(x, is_causal=True)``.

    Works for ``MultiHeadAttention`` and ``GroupedQueryAttention`` (the cache then stores only
    ``num_kv_heads`` heads): it runs the module's own projections and attention step
    (``module.attend``) on the new queries and the cached keys and values. Subclasses that change
    ``forward`` or ``attend`` are refused: ``DynamicHeadAttention``'s head weights pool the whole
    sequence and relative positions are measured inside the call, so caching would change what
    they compute.
    """
    kind = type(module)
    if (
        not isinstance(module, MultiHeadAttention)
        or kind.forward is not MultiHeadAttention.forward
        or kind.attend not in (MultiHeadAttention.attend, GroupedQueryAttention.attend)
    ):
        raise TypeError(
            "decode_step supports MultiHeadAttention and GroupedQueryAttention, got "
            f"{kind.__name__}: a module that overrides forward or attend would lose its extra step under the cache"
        )
    if not isinstance(cache, KVCache):
        raise TypeError(f"cache must be a KVCache, got {type(cache).__name__}")
    if module.kdim != module.d_model or module.vdim != module.d_model:
        raise ValueError("decode_step is for self-attention: the module must have kdim == vdim == d_model")
    module._check_inputs(x, x, x)
    num_kv_heads = module.num_kv_heads
    if (cache.num_kv_heads, cache.head_dim) != (num_kv_heads, module.head_dim) or cache.batch_size != x.shape[0]:
        raise ValueError(
            f"the cache is (B, Hkv, D) = ({cache.batch_size}, {cache.num_kv_heads}, {cache.head_dim}) but the module "
            f"and input need ({x.shape[0]}, {num_kv_heads}, {module.head_dim}); use KVCache.for_module(module, ...)"
        )
    T = x.shape[1]
    q = split_heads(module.q_proj(x), module.num_heads)  # (B, H, T, D)
    k = split_heads(module.k_proj(x), num_kv_heads)  # (B, Hkv, T, D)
    v = split_heads(module.v_proj(x), num_kv_heads)  # (B, Hkv, T, D)
    keys, values = cache.append(k, v)  # (B, Hkv, S, D) each
    S = keys.shape[2]
    # The new queries are the last T of S positions: bottom-right causal alignment.
    causal = causal_mask(S, device=x.device)[-T:] if T > 1 else None  # (T, S), or None: one query sees all
    if mask is not None and mask.dtype != torch.bool:
        raise TypeError(f"decode_step takes a boolean mask (True = may attend), got {mask.dtype}")
    allowed = combine_masks(mask, causal)  # broadcastable to (B, H, T, S), or None
    context, _ = module.attend(q, keys, values, mask=allowed)  # (B, H, T, D)
    return module.out_proj(merge_heads(context))  # (B, T, E)


# --------------------------------------------------------------------------------------------
# How big the cache gets: MHA, GQA and MQA side by side
# --------------------------------------------------------------------------------------------


def kv_cache_bytes(
    *,
    batch_size: int,
    seq_len: int,
    num_kv_heads: int,
    head_dim: int,
    num_layers: int = 1,
    dtype: torch.dtype = torch.float32,
) -> int:
    """Bytes a KV cache needs: keys and values for every layer, sequence, position and K/V head.

        2 (K and V) x num_layers x batch_size x seq_len x num_kv_heads x head_dim x bytes per element

    It scales with ``num_kv_heads``, not with the number of query heads: that is the point of
    MQA and GQA. :attr:`KVCache.nbytes` is this figure for a real buffer.
    """
    for name, value in (
        ("batch_size", batch_size),
        ("seq_len", seq_len),
        ("num_kv_heads", num_kv_heads),
        ("head_dim", head_dim),
        ("num_layers", num_layers),
    ):
        check_positive_int(name, value)
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype, got {type(dtype).__name__}")
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * batch_size * seq_len * num_kv_heads * head_dim * itemsize


def compare_kv_cache_memory(
    *,
    d_model: int,
    num_heads: int,
    kv_heads: tuple[int, ...] | None = None,
    batch_size: int = 1,
    seq_len: int = 4096,
    num_layers: int = 1,
    dtype: torch.dtype = torch.float32,
) -> list[dict[str, object]]:
    """KV-cache size of MHA, GQA and MQA for one model shape, one row per ``num_kv_heads``.

    ``kv_heads`` defaults to every divisor of ``num_heads``, from ``num_heads`` (MHA) down to
    1 (MQA). Each row: ``name``, ``num_kv_heads``, ``bytes``, ``mib``, and ``fraction`` (of
    the MHA cache, i.e. ``num_kv_heads / num_heads``).
    """
    d_model, num_heads = check_positive_int("d_model", d_model), check_positive_int("num_heads", num_heads)
    if d_model % num_heads != 0:
        raise ValueError(f"d_model={d_model} is not divisible by num_heads={num_heads}")
    head_dim = d_model // num_heads
    if kv_heads is None:
        kv_heads = tuple(h for h in range(num_heads, 0, -1) if num_heads % h == 0)
    full = kv_cache_bytes(
        batch_size=batch_size, seq_len=seq_len, num_kv_heads=num_heads, head_dim=head_dim,
        num_layers=num_layers, dtype=dtype,
    )
    rows = []
    for count in kv_heads:
        count = check_positive_int("num_kv_heads", count)
        if num_heads % count != 0:
            raise ValueError(f"num_heads={num_heads} is not divisible by num_kv_heads={count}")
        name = "MHA" if count == num_heads else "MQA" if count == 1 else f"GQA-{count}"
        size = kv_cache_bytes(
            batch_size=batch_size, seq_len=seq_len, num_kv_heads=count, head_dim=head_dim,
            num_layers=num_layers, dtype=dtype,
        )
        rows.append({"name": name, "num_kv_heads": count, "bytes": size, "mib": size / 2**20, "fraction": size / full})
    return rows
