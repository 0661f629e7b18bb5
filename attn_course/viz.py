"""Plain matplotlib pictures of attention: one heatmap, a grid of heads, a mask.

Every helper draws onto an ``Axes`` you pass, or creates its own ``matplotlib.figure.Figure``
(not a pyplot figure, so nothing piles up in pyplot's global state when widgets redraw), and
returns the ``Figure``. In a notebook, a returned figure displays when it is the cell's last
expression. The widgets in ``attn_course.widgets`` draw with these helpers.

Shape legend: H heads, L query length, S key length. Weights are ``(L, S)``: row ``i`` is how
query ``i`` spreads its attention over the keys.

Used from lesson 01 on.
"""

from __future__ import annotations

import io
import math
from collections.abc import Sequence

import numpy as np
import torch
from matplotlib.axes import Axes
from matplotlib.colors import ListedColormap
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from ._checks import shape_str

__all__ = [
    "MAX_TOKENS",
    "plot_attention",
    "plot_heads",
    "plot_mask",
    "plot_patch_attention",
    "figure_to_png",
]

# Widgets draw at most this many query and key positions: beyond that a heatmap is a blur
# and redrawing stops feeling instant. Plain helpers draw whatever they are given.
MAX_TOKENS = 64
# Tick labels are drawn only up to this many positions (more would overlap).
_MAX_LABELS = 40
_MASK_COLORS = ListedColormap(["#d9d9d9", "#2c7fb8"])  # False (blocked): grey, True (may attend): blue


def _as_matrix(name: str, x: object, *, expect_bool: bool | None = None) -> torch.Tensor:
    """A 2-D CPU tensor from ``x``, or a TypeError/ValueError that names what was expected."""
    if not isinstance(x, torch.Tensor):
        try:
            x = torch.as_tensor(x)
        except Exception:
            raise TypeError(f"{name} must be a 2-D tensor (L, S), got {type(x).__name__}") from None
    if x.dim() != 2:
        raise ValueError(f"{name} must be 2-D (L, S), got shape {shape_str(x.shape)}; pick one example and head first")
    if expect_bool is True and x.dtype != torch.bool:
        raise TypeError(f"{name} must be a boolean mask (True = may attend), got dtype {x.dtype}")
    if expect_bool is False and not x.dtype.is_floating_point:
        raise TypeError(f"{name} must be floating point, got dtype {x.dtype}")
    return x.detach().cpu()


def _check_labels(name: str, labels: Sequence[str] | None, n: int) -> list[str] | None:
    if labels is None:
        return None
    labels = [str(label) for label in labels]
    if len(labels) != n:
        raise ValueError(f"{name} has {len(labels)} labels for {n} positions")
    return labels


def _new_axes(ax: Axes | None, figsize: tuple[float, float]) -> Axes:
    if ax is not None:
        return ax
    return Figure(figsize=figsize, layout="constrained").add_subplot()


def _label_axes(ax: Axes, query_labels: list[str] | None, key_labels: list[str] | None, L: int, S: int) -> None:
    """Token labels on the ticks when there are few enough, else plain position numbers."""
    if key_labels is not None and S <= _MAX_LABELS:
        ax.set_xticks(range(S), key_labels, rotation=90 if max(map(len, key_labels)) > 2 else 0)
    if query_labels is not None and L <= _MAX_LABELS:
        ax.set_yticks(range(L), query_labels)
    ax.set_xlabel("key position (attended to)")
    ax.set_ylabel("query position")


def plot_attention(
    weights: torch.Tensor,
    *,
    ax: Axes | None = None,
    query_labels: Sequence[str] | None = None,
    key_labels: Sequence[str] | None = None,
    title: str | None = None,
    vmax: float | None = 1.0,
    colorbar: bool = True,
    cmap: str = "viridis",
) -> Figure:
    """Heatmap of one attention matrix ``(L, S)``: rows are queries, columns keys.

    ``vmax=1.0`` keeps the colour scale fixed (weights are probabilities), so two heads
    drawn side by side compare honestly; pass ``None`` to stretch the scale to the data.
    """
    weights = _as_matrix("weights", weights, expect_bool=False)
    L, S = weights.shape
    query_labels = _check_labels("query_labels", query_labels, L)
    key_labels = _check_labels("key_labels", key_labels, S)
    ax = _new_axes(ax, (max(3.0, 0.25 * S + 1.5), max(2.5, 0.25 * L + 1.0)))
    image = ax.imshow(weights.float().numpy(), cmap=cmap, vmin=0.0, vmax=vmax, aspect="auto", interpolation="nearest")
    _label_axes(ax, query_labels, key_labels, L, S)
    if title:
        ax.set_title(title)
    if colorbar:
        ax.figure.colorbar(image, ax=ax, fraction=0.05, pad=0.02, label="weight")
    return ax.figure


def plot_heads(
    weights: torch.Tensor,
    *,
    query_labels: Sequence[str] | None = None,
    key_labels: Sequence[str] | None = None,
    titles: Sequence[str] | None = None,
    ncols: int = 4,
    suptitle: str | None = None,
    panel_size: float = 2.6,
) -> Figure:
    """A grid of heatmaps, one per head, from weights ``(H, L, S)``; one shared colour scale."""
    if not isinstance(weights, torch.Tensor) or weights.dim() != 3:
        got = shape_str(weights.shape) if isinstance(weights, torch.Tensor) else type(weights).__name__
        raise ValueError(f"weights must be a tensor (H, L, S), got {got}")
    if ncols < 1:
        raise ValueError(f"ncols must be >= 1, got {ncols}")
    H, L, S = weights.shape
    titles = list(titles) if titles is not None else [f"head {h}" for h in range(H)]
    if len(titles) != H:
        raise ValueError(f"got {len(titles)} titles for {H} heads")
    ncols = min(ncols, H)
    nrows = math.ceil(H / ncols)
    fig = Figure(figsize=(panel_size * ncols + 0.8, panel_size * nrows + 0.4), layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False)
    for h, ax in enumerate(axes.flat):
        if h >= H:
            ax.set_axis_off()
            continue
        plot_attention(
            weights[h],
            ax=ax,
            query_labels=query_labels,
            key_labels=key_labels,
            title=titles[h],
            colorbar=False,
        )
        if h % ncols:  # y labels on the first column only
            ax.set_ylabel("")
        if h < H - ncols:  # x labels on the bottom row only
            ax.set_xlabel("")
    fig.colorbar(axes.flat[0].images[0], ax=axes, fraction=0.03, pad=0.02, label="weight")
    if suptitle:
        fig.suptitle(suptitle)
    return fig


def plot_mask(
    mask: torch.Tensor,
    *,
    ax: Axes | None = None,
    query_labels: Sequence[str] | None = None,
    key_labels: Sequence[str] | None = None,
    title: str | None = None,
) -> Figure:
    """A boolean mask ``(L, S)``: blue where the query may attend (True), grey where blocked.

    Drawn in this course's convention (True = may attend, as in
    ``F.scaled_dot_product_attention``), whatever API the mask is headed for.
    """
    mask = _as_matrix("mask", mask, expect_bool=True)
    L, S = mask.shape
    query_labels = _check_labels("query_labels", query_labels, L)
    key_labels = _check_labels("key_labels", key_labels, S)
    ax = _new_axes(ax, (max(3.0, 0.25 * S + 1.5), max(2.5, 0.25 * L + 1.0)))
    ax.imshow(mask.numpy(), cmap=_MASK_COLORS, vmin=0, vmax=1, aspect="auto", interpolation="nearest")
    # Thin white grid lines between cells make small masks easy to count.
    if L <= _MAX_LABELS and S <= _MAX_LABELS:
        ax.set_xticks([x - 0.5 for x in range(1, S)], minor=True)
        ax.set_yticks([y - 0.5 for y in range(1, L)], minor=True)
        ax.grid(which="minor", color="white", linewidth=1)
        ax.tick_params(which="minor", length=0)
    _label_axes(ax, query_labels, key_labels, L, S)
    ax.set_title(title if title is not None else "blue = may attend (True)")
    return ax.figure


def plot_patch_attention(
    image: torch.Tensor,
    weights: torch.Tensor,
    *,
    ax: Axes | None = None,
    title: str | None = None,
    vmax: float | None = None,
    outline: int | None = None,
    colorbar: bool = False,
    cmap: str = "magma",
) -> Figure:
    """Attention over the image itself: one token's weights on a grid of patches, the ink on top.

    ``image`` ``(h, w)`` holds ink in ``[0, 1]`` (0 = blank paper); ``weights`` ``(gh, gw)`` are
    one query's weights over the patches, laid out on the patch grid (row by row, as
    ``attn_course.vit.patchify`` numbers them; each patch covers ``h/gh x w/gw`` pixels). The
    weights fill each patch's square in colour (dark = little, bright = much); the digit is
    drawn over them as cyan outlines of its ink, so both stay readable. ``outline`` draws a box
    around patch ``n`` (the query's own patch). ``vmax=None`` stretches the colours to the
    largest weight shown.
    """
    image = _as_matrix("image", image, expect_bool=False)
    weights = _as_matrix("weights", weights, expect_bool=False)
    h, w = image.shape
    gh, gw = weights.shape
    if h % gh or w % gw:
        raise ValueError(f"the patch grid {gh}x{gw} must tile the image {h}x{w}")
    ax = _new_axes(ax, (3.0, 3.0))
    shown = ax.imshow(weights.float().numpy(), cmap=cmap, vmin=0.0, vmax=vmax, extent=(0, w, h, 0),
                      interpolation="nearest")
    ink = image.float().clamp(0, 1).numpy()
    centres_x, centres_y = np.arange(w) + 0.5, np.arange(h) + 0.5  # pixel centres in the extent's units
    ax.contour(centres_x, centres_y, ink, levels=[0.4], colors="#00e5ff", linewidths=1.8)
    if outline is not None:
        if not 0 <= outline < gh * gw:
            raise ValueError(f"outline must be a patch index in [0, {gh * gw}), got {outline}")
        ph, pw = h // gh, w // gw
        r, c = divmod(outline, gw)
        ax.add_patch(Rectangle((c * pw, r * ph), pw, ph, fill=False, edgecolor="white", linestyle="--", linewidth=2.0))
    ax.set_xticks([])
    ax.set_yticks([])
    ax.set_xlim(0, w)
    ax.set_ylim(h, 0)
    if title:
        ax.set_title(title, fontsize=9)
    if colorbar:
        ax.figure.colorbar(shown, ax=ax, fraction=0.05, pad=0.02, label="weight")
    return ax.figure


def figure_to_png(fig: Figure, *, dpi: int = 100) -> bytes:
    """The figure rendered to PNG bytes (what the widgets put in their ``Image``)."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi)
    return buffer.getvalue()
