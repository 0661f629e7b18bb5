"""Multi-query and grouped-query attention: fewer key/value heads than query heads.

Multi-head attention gives every query head its own key and value head. During decoding
the keys and values of every past token are kept in a KV cache (``attn_course.kv_cache``),
and that cache, not the arithmetic, is what limits long generations. Two fixes share K/V
heads between query heads:

* **multi-query attention** (MQA; Shazeer, 2019): one K/V head for all ``H`` query heads;
* **grouped-query attention** (GQA; Ainslie et al., 2023): ``num_kv_heads`` K/V heads, each
  shared by ``R = num_heads // num_kv_heads`` consecutive query heads (R repeats; lesson 11 names a
  layout GQA-G after its G = Hkv key/value heads).

Both are one module here: ``num_kv_heads=1`` is MQA, ``num_kv_heads=num_heads`` is ordinary
multi-head attention. Query head ``h`` reads K/V head ``h // R``, which is what
``repeat_kv`` (``repeat_interleave`` along the head axis) spells out; the module gets the
same numbers without copying K or V, by folding the R query heads of a group into the
query axis.

Shape legend: B batch, H query heads, Hkv key/value heads, R = H // Hkv, L query length,
S key length, D head dim, E model dim. Masks: bool, True = may attend.

Taught in lesson 11 (dynamic heads and beyond).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ._checks import check_mask, check_positive_int, check_tensor, shape_str
from .attention import scaled_dot_product_attention
from .masks import with_causal
from .multihead import MultiHeadAttention

__all__ = ["GroupedQueryAttention", "grouped_attention", "repeat_kv"]


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """``(B, Hkv, S, D)`` -> ``(B, Hkv * n_rep, S, D)``: each K/V head repeated for its query group.

    ``repeat_interleave`` puts the copies of head 0 first (heads 0, 0, 1, 1, ... for
    ``n_rep=2``), so query head ``h`` meets K/V head ``h // n_rep``. This materialises the
    copies; it is the reference that ``grouped_attention`` is tested against.
    """
    check_tensor("x", x, min_dim=1)
    if x.dim() != 4:
        raise ValueError(f"x must be (B, Hkv, S, D), got shape {shape_str(x.shape)}")
    n_rep = check_positive_int("n_rep", n_rep)
    return x.repeat_interleave(n_rep, dim=1)  # (B, Hkv * n_rep, S, D)


def _fold_mask(mask: torch.Tensor, *, B: int, H: int, L: int, S: int, num_kv_heads: int) -> torch.Tensor:
    """A mask broadcastable to ``(B, H, L, S)`` -> ``(B or 1, Hkv, R * L, S)``, matching folded queries."""
    mask = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))  # (b, h, l, s), each 1 or full size
    mask = mask.expand(mask.shape[0], H, L, S)  # (b, H, L, S), a view
    return mask.reshape(mask.shape[0], num_kv_heads, (H // num_kv_heads) * L, S)  # (b, Hkv, R * L, S)


def grouped_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    is_causal: bool = False,
    scale: float | None = None,
    dropout_p: float = 0.0,
    need_weights: bool = False,
    fused: bool | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention where ``H`` query heads share ``Hkv`` key/value heads (``Hkv`` divides ``H``).

    Args:
        q: queries ``(B, H, L, D)``.
        k: keys ``(B, Hkv, S, D)``.
        v: values ``(B, Hkv, S, Dv)``.
        mask: bool (True = may attend) or float (additive), broadcastable to ``(B, H, L, S)``.
        is_causal: top-left aligned causal mask, as in ``scaled_dot_product_attention``.
        scale, dropout_p, need_weights, fused: as in
            ``attn_course.scaled_dot_product_attention``.

    Returns:
        ``out`` ``(B, H, L, Dv)``, or ``(out, weights)`` with weights ``(B, H, L, S)``.
        Equal to ``scaled_dot_product_attention(q, repeat_kv(k, R), repeat_kv(v, R))``.

    How: the R query heads of a group all read the same keys and values, so they are just
    R times more queries for that K/V head. We fold them into the query axis,
    ``(B, H, L, D) -> (B, Hkv, R * L, D)``, and run ordinary attention against the
    ``Hkv`` K/V heads as they are -- K and V are never copied.
    """
    for name, x in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, x, min_dim=1)
        if x.dim() != 4:
            raise ValueError(f"{name} must be 4-D (B, heads, length, D), got shape {shape_str(x.shape)}")
    B, H, L, D = q.shape
    if k.shape[1] != v.shape[1]:
        raise ValueError(
            f"k and v must have the same number of heads Hkv: k {shape_str(k.shape)}, v {shape_str(v.shape)}"
        )
    num_kv_heads = k.shape[1]
    if H % num_kv_heads != 0:
        raise ValueError(
            f"the {H} query heads cannot be split evenly over {num_kv_heads} key/value heads: num_heads must be a "
            f"multiple of num_kv_heads (q {shape_str(q.shape)}, k {shape_str(k.shape)})"
        )
    if k.shape[0] != B or v.shape[0] != B:
        raise ValueError(
            f"q, k and v must share the batch size B: q {shape_str(q.shape)}, k {shape_str(k.shape)}, "
            f"v {shape_str(v.shape)}"
        )
    n_rep = H // num_kv_heads
    S = k.shape[2]
    if mask is not None:
        mask = check_mask(mask, (B, H, L, S), device=q.device)
    if is_causal:
        # Folding R heads into the query axis would shift a top-left causal mask between
        # heads, so the causal pattern is written out per head before folding.
        mask = with_causal(mask, L, S, device=q.device)  # (..., L, S)
    if mask is not None:
        mask = _fold_mask(mask, B=B, H=H, L=L, S=S, num_kv_heads=num_kv_heads)  # (B or 1, Hkv, R * L, S)
    q_folded = q.reshape(B, num_kv_heads, n_rep * L, D)  # (B, Hkv, R * L, D); query head h = kv * R + r
    attended = scaled_dot_product_attention(
        q_folded,
        k,
        v,
        mask,
        scale=scale,
        dropout_p=dropout_p,
        need_weights=need_weights,
        fused=fused,
    )
    if need_weights:
        out, weights = attended  # (B, Hkv, R * L, Dv), (B, Hkv, R * L, S)
        return out.reshape(B, H, L, -1), weights.reshape(B, H, L, S)  # (B, H, L, Dv), (B, H, L, S)
    return attended.reshape(B, H, L, -1)  # (B, H, L, Dv)


class GroupedQueryAttention(MultiHeadAttention):
    """Grouped-query attention (Ainslie et al., 2023); MQA when ``num_kv_heads=1``.

    A ``MultiHeadAttention`` whose key and value projections produce ``num_kv_heads`` heads
    of size ``head_dim = d_model // num_heads`` instead of ``num_heads``: ``k_proj`` and
    ``v_proj`` map to ``num_kv_heads * head_dim`` features, and the attention step
    (:meth:`attend`) is :func:`grouped_attention`. Everything else -- the query and output
    projections, ``forward`` itself, its arguments and the returned shapes -- is
    ``MultiHeadAttention``'s.

    Args:
        d_model: model dim E.
        num_heads: query heads H; must divide ``d_model``.
        num_kv_heads: key/value heads Hkv; must divide ``num_heads``. ``None`` (the default)
            means ``num_heads``: plain multi-head attention.
        bias, dropout, kdim, vdim, fused, device, dtype: as in ``MultiHeadAttention``.
    """

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        num_kv_heads: int | None = None,
        *,
        bias: bool = True,
        dropout: float = 0.0,
        kdim: int | None = None,
        vdim: int | None = None,
        fused: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(
            d_model, num_heads, bias=bias, dropout=dropout, kdim=kdim, vdim=vdim, fused=fused, device=device, dtype=dtype
        )
        num_kv_heads = num_heads if num_kv_heads is None else check_positive_int("num_kv_heads", num_kv_heads)
        if num_heads % num_kv_heads != 0:
            choices = [h for h in range(1, num_heads + 1) if num_heads % h == 0]
            raise ValueError(
                f"num_heads={num_heads} is not divisible by num_kv_heads={num_kv_heads}: every key/value head "
                f"serves the same number of query heads, so num_kv_heads must be one of {choices}"
            )
        self.num_kv_heads = num_kv_heads
        self.n_rep = num_heads // num_kv_heads  # R: query heads per key/value head
        factory = {"device": device, "dtype": dtype}
        kv_features = num_kv_heads * self.head_dim
        # Replace the parent's (E -> E) key/value projections by narrower ones.
        self.k_proj = nn.Linear(self.kdim, kv_features, bias=bias, **factory)
        self.v_proj = nn.Linear(self.vdim, kv_features, bias=bias, **factory)

    def extra_repr(self) -> str:
        return (
            f"d_model={self.d_model}, num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, "
            f"head_dim={self.head_dim}, dropout={self.dropout}"
        )

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
        mask: torch.Tensor | None = None, is_causal: bool = False, need_weights: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The attention step with shared K/V heads: q ``(B, H, L, D)``, k and v ``(B, Hkv, S, D)``.

        ``MultiHeadAttention.forward`` projects (k_proj and v_proj to ``Hkv`` heads), splits and
        merges as usual; only this step differs: :func:`grouped_attention` instead of
        ``scaled_dot_product_attention``. Returns ``(context (B, H, L, D), weights (B, H, L, S) or None)``.
        """
        attended = grouped_attention(q, k, v, mask, is_causal=is_causal, need_weights=need_weights, **self._kernel_options())
        return attended if need_weights else (attended, None)  # (B, H, L, D), (B, H, L, S) or None

    @classmethod
    def from_multihead(cls, module: MultiHeadAttention, num_kv_heads: int) -> GroupedQueryAttention:
        """Convert a trained ``MultiHeadAttention`` to GQA by mean-pooling its K/V heads per group.

        This is the checkpoint conversion of Ainslie et al. (2023): the key (and value)
        projection of each group is the mean of the projections of the heads in it; the query
        and output projections are copied. Exact when the heads of a group were already equal,
        an approximation to fine-tune ("uptrain") from otherwise.
        """
        if not isinstance(module, MultiHeadAttention) or isinstance(module, GroupedQueryAttention):
            raise TypeError(f"from_multihead expects a MultiHeadAttention, got {type(module).__name__}")
        weight = module.q_proj.weight
        has_bias = module.q_proj.bias is not None
        new = cls(
            module.d_model,
            module.num_heads,
            num_kv_heads,
            bias=has_bias,
            dropout=module.dropout,
            kdim=module.kdim,
            vdim=module.vdim,
            fused=module.fused,
            device=weight.device,
            dtype=weight.dtype,
        )
        D, n_rep = new.head_dim, new.n_rep
        with torch.no_grad():
            new.q_proj.load_state_dict(module.q_proj.state_dict())
            new.out_proj.load_state_dict(module.out_proj.state_dict())
            for name in ("k_proj", "v_proj"):
                source, target = getattr(module, name), getattr(new, name)
                w = source.weight.view(num_kv_heads, n_rep, D, source.in_features)  # (Hkv, R, D, in)
                target.weight.copy_(w.mean(dim=1).reshape(num_kv_heads * D, source.in_features))  # (Hkv * D, in)
                if has_bias:
                    b = source.bias.view(num_kv_heads, n_rep, D)  # (Hkv, R, D)
                    target.bias.copy_(b.mean(dim=1).reshape(num_kv_heads * D))  # (Hkv * D,)
        new.train(module.training)
        return new

