"""Multi-head attention, batch-first, with an exact bridge to ``torch.nn.MultiheadAttention``.

Shape legend: B batch, H heads, L query length, S key length, D head dim (``head_dim``),
E model dim (``d_model`` = H * D).

    query (B, L, E) -> q_proj -> (B, L, E) -> split heads -> (B, H, L, D)
    key   (B, S, E) -> k_proj -> (B, S, E) -> split heads -> (B, H, S, D)
    value (B, S, E) -> v_proj -> (B, S, E) -> split heads -> (B, H, S, D)
    attention per head -> (B, H, L, D) -> merge heads -> (B, L, E) -> out_proj -> (B, L, E)

The middle step, ``attend``, is the one method a variant overrides: grouped-query attention
(``attn_course.grouped``) attends with fewer key/value heads, dynamic head weighting
(``attn_course.dynamic``) rescales each head's output, relative positions
(``attn_course.positional``) add a position term to the scores. The projections, the head
split and merge, the input checks and ``forward``'s contract stay here, written once.

Mask convention: bool, True = may attend, broadcastable to ``(B, H, L, S)`` -- e.g. a
causal ``(L, S)`` mask or a padding mask ``(B, 1, 1, S)``. This is the opposite of
``nn.MultiheadAttention`` (True = blocked); see ``attn_course.from_blocked_mask``.

Taught in lesson 02 (multi-head attention).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ._checks import check_positive_int, check_tensor, shape_str
from .attention import scaled_dot_product_attention

__all__ = ["MultiHeadAttention", "split_heads", "merge_heads"]


def split_heads(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """``(B, L, E)`` -> ``(B, H, L, D)`` with ``D = E // H``.

    The ``view`` is free (no copy); the ``transpose`` is free too but leaves the result
    non-contiguous: the copy is paid later, by whoever needs contiguous memory.
    """
    B, L, E = x.shape
    x = x.view(B, L, num_heads, E // num_heads)  # (B, L, H, D)
    return x.transpose(1, 2)  # (B, H, L, D), non-contiguous view


def merge_heads(x: torch.Tensor) -> torch.Tensor:
    """``(B, H, L, D)`` -> ``(B, L, E)``: move the head axis back next to D, then flatten.

    Skipping the transpose (``x.reshape(B, L, E)`` straight from ``(B, H, L, D)``) is the
    classic bug: it runs, but mixes different tokens into one output row.
    """
    B, H, L, D = x.shape
    x = x.transpose(1, 2)  # (B, L, H, D), non-contiguous
    return x.reshape(B, L, H * D)  # (B, L, E), copies here because of the transpose


class MultiHeadAttention(nn.Module):
    """Multi-head attention (Vaswani et al., 2017), batch-first.

    ``forward`` runs project -> split -> :meth:`attend` -> merge -> project; subclasses change
    the attention itself by overriding :meth:`attend` (see the module docstring).

    Args:
        d_model: model dim E (size of each query token).
        num_heads: number of heads H; must divide ``d_model``. Each head has
            ``head_dim = d_model // num_heads``.
        bias: add biases to the four projections.
        dropout: dropout on the attention weights, active in training mode only.
        kdim, vdim: feature sizes of key and value inputs (default ``d_model``), for
            cross-attention between different spaces.
        fused: use PyTorch's fused kernel when weights are not requested; ``False``
            always runs the explicit path (slower, same result).
        device, dtype: where and how to create the parameters.
    """

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        *,
        bias: bool = True,
        dropout: float = 0.0,
        kdim: int | None = None,
        vdim: int | None = None,
        fused: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        check_positive_int("d_model", d_model)
        check_positive_int("num_heads", num_heads)
        if d_model % num_heads != 0:
            divisors = [h for h in range(1, d_model + 1) if d_model % h == 0]
            raise ValueError(
                f"d_model={d_model} is not divisible by num_heads={num_heads} (head_dim would be "
                f"{d_model / num_heads:.3g}); num_heads must be one of {divisors}"
            )
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        factory = {"device": device, "dtype": dtype}
        self.d_model = d_model
        self.num_heads = num_heads
        self.head_dim = d_model // num_heads
        self.num_kv_heads = num_heads  # key/value heads: one per query head (GroupedQueryAttention has fewer)
        self.kdim = d_model if kdim is None else kdim
        self.vdim = d_model if vdim is None else vdim
        self.dropout = dropout
        self.fused = fused
        self.q_proj = nn.Linear(d_model, d_model, bias=bias, **factory)
        self.k_proj = nn.Linear(self.kdim, d_model, bias=bias, **factory)
        self.v_proj = nn.Linear(self.vdim, d_model, bias=bias, **factory)
        self.out_proj = nn.Linear(d_model, d_model, bias=bias, **factory)

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}, num_heads={self.num_heads}, head_dim={self.head_dim}, dropout={self.dropout}"

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None = None,
        value: torch.Tensor | None = None,
        *,
        mask: torch.Tensor | None = None,
        is_causal: bool = False,
        need_weights: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Attend from ``query`` ``(B, L, E)`` to ``key`` ``(B, S, kdim)`` / ``value`` ``(B, S, vdim)``.

        ``key`` defaults to ``query`` and ``value`` to ``key`` (self-attention). ``mask`` is
        bool (True = may attend) or float (additive), broadcastable to ``(B, H, L, S)``.
        Returns ``out`` ``(B, L, E)``, or ``(out, weights)`` with per-head weights
        ``(B, H, L, S)`` when ``need_weights`` is True.
        """
        key, value = self._check_inputs(query, key, value, mask)
        return self._project_attend_merge(query, key, value, need_weights=need_weights, mask=mask, is_causal=is_causal)

    def _project_attend_merge(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, need_weights: bool, **attend_options
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The pipeline every variant shares: project -> split heads -> attend -> merge heads -> project.

        ``attend_options`` (the mask, ``is_causal``, and whatever a subclass's :meth:`attend`
        takes) are passed to :meth:`attend` untouched.
        """
        q = split_heads(self.q_proj(query), self.num_heads)  # (B, H, L, D)
        k = split_heads(self.k_proj(key), self.num_kv_heads)  # (B, Hkv, S, D)
        v = split_heads(self.v_proj(value), self.num_kv_heads)  # (B, Hkv, S, D)
        context, weights = self.attend(q, k, v, need_weights=need_weights, **attend_options)  # (B, H, L, D)
        out = self.out_proj(merge_heads(context))  # (B, L, E)
        return (out, weights) if need_weights else out

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        mask: torch.Tensor | None = None,
        is_causal: bool = False,
        need_weights: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The attention step, per head: q ``(B, H, L, D)``, k and v ``(B, Hkv, S, D)`` -> ``(context, weights)``.

        ``context`` is ``(B, H, L, D)``; ``weights`` ``(B, H, L, S)`` when ``need_weights``, else
        None. Here: ``scaled_dot_product_attention`` per head, with this module's attention
        dropout (in training mode) and its ``fused`` choice. Override it to change how the heads
        attend; ``forward`` then needs no change.
        """
        attended = scaled_dot_product_attention(
            q, k, v, mask, is_causal=is_causal, need_weights=need_weights, **self._kernel_options()
        )
        return attended if need_weights else (attended, None)  # (B, H, L, D), (B, H, L, S) or None

    def _kernel_options(self) -> dict[str, object]:
        """The attention kernel's ``dropout_p`` (active in training mode only) and ``fused`` choice."""
        return {"dropout_p": self.dropout if self.training else 0.0, "fused": None if self.fused else False}

    def _check_inputs(
        self, query: object, key: object | None = None, value: object | None = None, mask: object = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Check query, key and value (key defaults to query, value to key) and a mask's layout.

        Returns ``(key, value)`` with the defaults filled in.
        """
        key = query if key is None else key
        value = key if value is None else value
        for name, x, features in (("query", query, self.d_model), ("key", key, self.kdim), ("value", value, self.vdim)):
            x = check_tensor(name, x, min_dim=1)
            if x.dim() != 3:
                hint = " For a single unbatched sequence (L, E) add a batch axis: x.unsqueeze(0)." if x.dim() == 2 else ""
                raise ValueError(f"{name} must be batch-first (B, L, E), got shape {shape_str(x.shape)}.{hint}")
            if x.shape[-1] != features:
                hint = ""
                if x.shape[0] == features or x.shape[1] == features:
                    hint = " Is it laid out (L, B, E) or (B, E, L)? This module is batch-first: (B, L, E)."
                raise ValueError(
                    f"{name} must have {features} features in its last dim (B, L, {features}), got shape "
                    f"{shape_str(x.shape)}.{hint}"
                )
        weight = self.q_proj.weight
        # Under autocast, low-precision activations meet float32 weights by design.
        autocast = torch.is_autocast_enabled(weight.device.type)
        for name, x in (("query", query), ("key", key), ("value", value)):
            if x.dtype != weight.dtype and not autocast:
                raise TypeError(
                    f"{name} has dtype {x.dtype} but the module's weights are {weight.dtype}; "
                    f"use x.to({weight.dtype}) or module.to({x.dtype})"
                )
            if x.device != weight.device:
                raise ValueError(f"{name} is on {x.device} but the module is on {weight.device}; move one of them")
        if key.shape[0] != query.shape[0] or value.shape[0] != query.shape[0]:
            raise ValueError(
                f"query, key and value must have the same batch size B: got {query.shape[0]}, {key.shape[0]}, "
                f"{value.shape[0]}"
            )
        if key.shape[1] != value.shape[1]:
            raise ValueError(
                f"key and value must have the same length S: key {shape_str(key.shape)}, value {shape_str(value.shape)}"
            )
        B, L, S = query.shape[0], query.shape[1], key.shape[1]
        if isinstance(mask, torch.Tensor) and mask.dim() == 2 and mask.shape == (B, S) and B != L:
            raise ValueError(
                f"mask has shape (B, S) = {shape_str(mask.shape)}, which does not broadcast to (B, H, L, S) "
                f"= {shape_str((B, self.num_heads, L, S))}: for a padding mask use mask[:, None, None, :]"
            )
        return key, value

    @classmethod
    def from_torch(cls, module: nn.MultiheadAttention) -> MultiHeadAttention:
        """Build a ``MultiHeadAttention`` holding a copy of an ``nn.MultiheadAttention``'s weights.

        The outputs then match ``module`` exactly (given batch-first inputs, and masks
        converted with ``from_blocked_mask``). ``in_proj_weight`` is ``[W_q; W_k; W_v]``
        stacked into ``(3E, E)``; we copy each third into its own projection.
        """
        if not isinstance(module, nn.MultiheadAttention):
            raise TypeError(f"from_torch expects an nn.MultiheadAttention, got {type(module).__name__}")
        if module.bias_k is not None or module.add_zero_attn:
            raise ValueError("from_torch does not support add_bias_kv=True or add_zero_attn=True")
        weight = module.out_proj.weight
        has_bias = module.in_proj_bias is not None
        new = cls(
            module.embed_dim,
            module.num_heads,
            bias=has_bias,
            dropout=module.dropout,
            kdim=module.kdim,
            vdim=module.vdim,
            device=weight.device,
            dtype=weight.dtype,
        )
        E = module.embed_dim
        with torch.no_grad():
            if module._qkv_same_embed_dim:
                w_q, w_k, w_v = module.in_proj_weight.split(E, dim=0)  # 3 x (E, E)
            else:
                w_q, w_k, w_v = module.q_proj_weight, module.k_proj_weight, module.v_proj_weight
            new.q_proj.weight.copy_(w_q)
            new.k_proj.weight.copy_(w_k)
            new.v_proj.weight.copy_(w_v)
            new.out_proj.weight.copy_(module.out_proj.weight)
            if has_bias:
                b_q, b_k, b_v = module.in_proj_bias.split(E)  # 3 x (E,)
                new.q_proj.bias.copy_(b_q)
                new.k_proj.bias.copy_(b_k)
                new.v_proj.bias.copy_(b_v)
                new.out_proj.bias.copy_(module.out_proj.bias)
        new.train(module.training)
        return new
