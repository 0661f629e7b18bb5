"""Dynamic head weighting: each input decides how much each attention head contributes.

A small gate reads a summary of the input (the mean of its real tokens), produces one
logit per head, and a softmax over heads turns them into weights ``w[b, h]``. Head ``h``'s
output for sequence ``b`` is multiplied by ``w[b, h]`` before the heads are merged and
projected, so the model can lean on different heads for different inputs.

The source article sketches this with a Python loop over ``max_heads`` separate
``SingleHeadAttention`` modules. Its sketch has several problems, fixed here:

* ``SingleHeadAttention`` is never defined, and each head is built for ``dim // max_heads``
  features while being fed the full ``dim``-wide input;
* the weighted head outputs are *summed*, not concatenated and projected, so the output has
  one head's width instead of the model's;
* softmax weights sum to 1, so every head is scaled down by about ``1/H`` compared with plain
  multi-head attention; we multiply by ``H`` so that uniform weights (all 1) give exactly
  ``MultiHeadAttention`` -- and the gate starts at zero, i.e. the module *starts as* plain MHA;
* the mean over the sequence includes padding tokens, so the weights (and every output)
  change with whatever the padding holds; here the mean is over real tokens only;
* one module per head run in a loop is slow; here all H heads are computed at once as
  ``(B, H, L, D)`` tensors by the package's attention.

One caution the article does not give: the pooled mean reads the whole sequence, so with
``is_causal=True`` the head weights of position ``i`` still depend on later tokens. That is
fine for encoders and classifiers, but it leaks the future in a decoder (and is why
``attn_course.kv_cache.decode_step`` refuses this module).

Shape legend: B batch, H heads, L query length, S key length, D head dim, E model dim.
Masks: bool, True = may attend; ``padding_mask`` is ``(B, L)``, True = real token.

Taught in lesson 11 (dynamic heads and beyond).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ._checks import check_tensor, shape_str
from .attention import scaled_dot_product_attention
from .masks import combine_masks, with_causal
from .multihead import MultiHeadAttention, split_heads

__all__ = ["DynamicHeadAttention"]


class DynamicHeadAttention(MultiHeadAttention):
    """Multi-head attention whose heads are re-weighted per input by a learned gate.

        pooled = mean of query[b, l] over real tokens l          (B, E)
        w      = H * softmax(gate(pooled))                        (B, H), sums to H
        out    = out_proj(merge_heads(w[b, h] * head_h output))   (B, L, E)

    The gate (``self.gate``, a ``Linear(E, H)``) is initialised to zero, so a fresh module has
    ``w = 1`` everywhere and computes exactly what ``MultiHeadAttention`` with the same
    projections computes. Arguments are those of ``MultiHeadAttention``; of its pipeline only the
    attention step (:meth:`attend`) is overridden, to scale each head's output.
    """

    def __init__(self, d_model: int, num_heads: int, **options: object) -> None:
        """``options``: ``MultiHeadAttention``'s keyword arguments (bias, dropout, kdim, vdim, fused, device, dtype)."""
        super().__init__(d_model, num_heads, **options)
        self.gate = nn.Linear(d_model, num_heads, device=options.get("device"), dtype=options.get("dtype"))
        nn.init.zeros_(self.gate.weight)  # start as plain multi-head attention (all weights 1)
        nn.init.zeros_(self.gate.bias)

    def _check_padding(self, query: torch.Tensor, padding_mask: object) -> torch.Tensor | None:
        if padding_mask is None:
            return None
        if not isinstance(padding_mask, torch.Tensor) or padding_mask.dtype != torch.bool:
            got = padding_mask.dtype if isinstance(padding_mask, torch.Tensor) else type(padding_mask).__name__
            raise TypeError(f"padding_mask must be a bool tensor (True = real token), got {got}")
        B, L = query.shape[:2]
        if padding_mask.shape != (B, L):
            raise ValueError(
                f"padding_mask must be (B, L) = ({B}, {L}), True = real token, got shape {shape_str(padding_mask.shape)}"
            )
        if padding_mask.device != query.device:
            raise ValueError(f"padding_mask is on {padding_mask.device} but query is on {query.device}")
        return padding_mask

    @staticmethod
    def _key_mask(
        mask: torch.Tensor | None, padding_mask: torch.Tensor | None, *, self_attention: bool
    ) -> torch.Tensor | None:
        """In self-attention the query's padding is also the keys' padding: fold it into ``mask``."""
        if not self_attention or padding_mask is None:
            return mask
        if mask is not None and (not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool):
            raise TypeError("with padding_mask, mask must be boolean (True = may attend) so the two can be combined")
        return combine_masks(mask, padding_mask[:, None, None, :])  # broadcastable to (B, H, L, S)

    def head_weights(self, query: torch.Tensor, *, padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        """The per-input head weights ``(B, H)``: ``H * softmax`` of the gate, so they sum to ``H``.

        ``query`` is ``(B, L, E)``; ``padding_mask`` ``(B, L)`` (True = real token) keeps padding
        out of the mean. A sequence with no real token pools to zeros (its weights then come
        from the gate's bias alone).
        """
        check_tensor("query", query, min_dim=1)
        if query.dim() != 3 or query.shape[-1] != self.d_model:
            raise ValueError(f"query must be (B, L, E) = (B, L, {self.d_model}), got shape {shape_str(query.shape)}")
        padding_mask = self._check_padding(query, padding_mask)
        if padding_mask is None:
            pooled = query.mean(dim=1)  # (B, E)
        else:
            keep = padding_mask.unsqueeze(-1).to(query.dtype)  # (B, L, 1)
            count = keep.sum(dim=1).clamp_min(1.0)  # (B, 1), at least 1 so empty sequences give 0
            pooled = (query * keep).sum(dim=1) / count  # (B, E), mean over real tokens only
        logits = self.gate(pooled)  # (B, H)
        return self.num_heads * torch.softmax(logits, dim=-1)  # (B, H), sums to H

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None = None,
        value: torch.Tensor | None = None,
        *,
        mask: torch.Tensor | None = None,
        padding_mask: torch.Tensor | None = None,
        is_causal: bool = False,
        need_weights: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Like ``MultiHeadAttention.forward``, with each head's output scaled by ``head_weights``.

        ``padding_mask`` ``(B, L)``, True = real query token, is left out of the pooled mean.
        In self-attention (``key`` not given) it also stops every query from attending to
        padded keys, combined with ``mask``; in cross-attention, mask the keys with ``mask``.
        The returned attention ``weights`` ``(B, H, L, S)`` are the per-head softmax weights,
        before the head weighting.
        """
        key, value, mask, padding_mask = self._prepare(query, key, value, mask=mask, padding_mask=padding_mask)
        head_weights = self.head_weights(query, padding_mask=padding_mask)  # (B, H)
        return self._project_attend_merge(
            query, key, value, need_weights=need_weights, mask=mask, is_causal=is_causal, head_weights=head_weights
        )

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, head_weights: torch.Tensor, **options: object
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``MultiHeadAttention``'s attention step, then head ``h``'s output times ``head_weights[:, h]``.

        ``head_weights`` ``(B, H)`` come from :meth:`head_weights`; ``options`` (mask, ``is_causal``,
        ``need_weights``) are those of ``MultiHeadAttention.attend``. The weights returned are
        the per-head softmax weights, before the head weighting.
        """
        context, weights = super().attend(q, k, v, **options)  # (B, H, L, D), (B, H, L, S) or None
        return context * head_weights[:, :, None, None], weights  # (B, H, L, D), head h scaled by w[b, h]

    def _prepare(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        *,
        mask: torch.Tensor | None,
        padding_mask: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Check the inputs; in self-attention fold the padding into the key mask. Returns key, value, mask, padding."""
        self_attention = key is None
        key, value = self._check_inputs(query, key, value, mask)
        padding_mask = self._check_padding(query, padding_mask)
        return key, value, self._key_mask(mask, padding_mask, self_attention=self_attention), padding_mask

    def attention_weights(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None = None,
        value: torch.Tensor | None = None,
        *,
        mask: torch.Tensor | None = None,
        padding_mask: torch.Tensor | None = None,
        is_causal: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Per-head attention weights ``(B, H, L, S)`` of a ``forward`` call with these arguments,
        and the mask they were computed with (causal and padding included; None = no mask).

        This is how ``attn_course.diagnostics.capture_attention`` reads this module's weights.
        """
        key, _, mask, _ = self._prepare(query, key, value, mask=mask, padding_mask=padding_mask)
        q = split_heads(self.q_proj(query), self.num_heads)  # (B, H, L, D)
        k = split_heads(self.k_proj(key), self.num_heads)  # (B, H, S, D)
        if is_causal:
            mask = with_causal(mask, q.shape[2], k.shape[2], device=q.device)  # (..., L, S)
        _, weights = scaled_dot_product_attention(q, k, k, mask, need_weights=True, fused=False)  # (B, H, L, S)
        return weights, mask
