"""Interactive explorers for the notebooks, built from core ipywidgets and matplotlib only.

No custom JavaScript and nothing fetched from a CDN, so they work offline, in JupyterLab and
in Colab. Each explorer is an object with

* ``.ui``: the ipywidgets box (displaying the explorer displays it);
* ``.draw(**state) -> Figure``: a plain method that draws one state into a matplotlib
  ``Figure``. The live view calls it on every change; notebooks call it for the static figure
  that GitHub shows; tests call it too;
* ``.figure``: the figure drawn for the current state of the controls;
* ``.save_png(path=None)``: writes the current figure to a PNG (the "Save PNG" button).

Explorers:

* ``HeadExplorer``: attention weights of a model -- layer / head / example selectors, a
  heatmap with token labels, or every head of a layer in a grid (lesson 02);
* ``PatchAttentionExplorer``: a Vision Transformer's attention drawn over the image itself --
  layer (or the rollout), head (or their mean), image and query token (lesson 09);
* ``ScaleExplorer``: how ``d_k``, the ``1/sqrt(d_k)`` scale and a temperature change the
  scores' spread and the softmax's sharpness (lesson 01);
* ``MaskExplorer``: causal, padding and combined masks and the weights they leave (lesson 03);
* ``PatternExplorer``: sparse attention patterns, their masks and density (lesson 05).

At most ``attn_course.viz.MAX_TOKENS`` (64) positions are drawn, so long inputs stay responsive.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import ipywidgets as widgets
import torch
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from ._checks import check_int, check_positive_int, shape_str
from .attention import scaled_dot_product_attention
from .masks import causal_mask, combine_masks, padding_mask
from .sparse import PATTERNS, pattern_mask
from .viz import MAX_TOKENS, figure_to_png, plot_attention, plot_heads, plot_mask, plot_patch_attention
from .vit import attention_rollout

__all__ = ["HeadExplorer", "PatchAttentionExplorer", "ScaleExplorer", "MaskExplorer", "PatternExplorer"]


class _Explorer:
    """Shared plumbing: controls -> ``draw`` -> PNG in an ``Image`` widget, plus "Save PNG"."""

    name = "explorer"

    def __init__(self, controls: Sequence[widgets.Widget], *, save_dir: str | Path = ".") -> None:
        self.save_dir = Path(save_dir)
        self.figure: Figure | None = None
        # Natural size, shrunk only to fit: a VBox would otherwise stretch the picture to its full width.
        self.image = widgets.Image(format="png", layout=widgets.Layout(max_width="100%", align_self="flex-start"))
        self.save_button = widgets.Button(description="Save PNG", icon="download", tooltip="write the figure to a PNG file")
        self.status = widgets.Label()
        self.save_button.on_click(lambda _button: self._on_save())
        self.ui = widgets.VBox([widgets.HBox(list(controls)), self.image, widgets.HBox([self.save_button, self.status])])
        for control in controls:
            control.observe(lambda _change: self.refresh(), names="value")

    @property
    def state(self) -> dict:
        """The controls' current values, as keyword arguments for ``draw``."""
        raise NotImplementedError

    def draw(self, **state) -> Figure:
        raise NotImplementedError

    def refresh(self) -> None:
        """Redraw for the controls' current values."""
        self.figure = self.draw(**self.state)
        self.image.value = figure_to_png(self.figure)

    def _default_path(self) -> Path:
        parts = "_".join(f"{key}{int(value) if isinstance(value, bool) else value}" for key, value in self.state.items())
        return self.save_dir / f"{self.name}_{parts.replace(' ', '').replace('+', '-')}.png"

    def save_png(self, path: str | Path | None = None, *, dpi: int = 150) -> Path:
        """Write the current figure to ``path`` (default: a name built from the state, in ``save_dir``)."""
        path = Path(path) if path is not None else self._default_path()
        path.parent.mkdir(parents=True, exist_ok=True)
        figure = self.figure if self.figure is not None else self.draw(**self.state)
        figure.savefig(path, format="png", dpi=dpi)
        return path

    def _on_save(self) -> None:
        try:
            self.status.value = f"saved {self.save_png()}"
        except OSError as error:  # a read-only folder must not break the widget
            self.status.value = f"could not save: {error}"

    def _ipython_display_(self) -> None:
        from IPython.display import display

        display(self.ui)


def _cap_note(n: int, cap: int) -> str:
    return f" (first {cap} of {n} positions)" if n > cap else ""


class HeadExplorer(_Explorer):
    """Browse attention weights by layer, head and example.

    Args:
        attention: one layer's weights ``(B, H, L, S)``, or a list of them (one per layer,
            as returned by ``TinyAttentionModel.attention_maps``).
        tokens: labels for the positions: one list of strings shared by every example, or
            one list per example. Labels of length S go on the key axis, of length L on the
            query axis (both, for self-attention). Default: position numbers.
        max_tokens: draw at most this many query and key positions (the first ones).
        save_dir: where "Save PNG" writes.
    """

    name = "heads"

    def __init__(
        self,
        attention: torch.Tensor | Sequence[torch.Tensor],
        tokens: Sequence[str] | Sequence[Sequence[str]] | None = None,
        *,
        max_tokens: int = MAX_TOKENS,
        save_dir: str | Path = ".",
    ) -> None:
        self.layers = self._check_attention(attention)
        self.max_tokens = _check_cap(max_tokens)
        B = self.layers[0].shape[0]
        self.tokens = self._check_tokens(tokens, B)
        self.layer = widgets.Dropdown(options=[(f"layer {i}", i) for i in range(len(self.layers))], description="layer")
        self.head = widgets.Dropdown(options=self._head_options(0), description="head")
        self.example = widgets.IntSlider(value=0, min=0, max=B - 1, description="example")
        self.all_heads = widgets.Checkbox(value=False, description="all heads")
        # Changing the layer may change the number of heads: fix the head menu before redrawing.
        self.layer.observe(self._sync_heads, names="value")
        super().__init__([self.layer, self.head, self.example, self.all_heads], save_dir=save_dir)
        self.refresh()

    @classmethod
    def from_model(cls, model: torch.nn.Module, tokens: torch.Tensor, labels=None, **kwargs) -> HeadExplorer:
        """Explore ``model.attention_maps(tokens)`` (e.g. a ``TinyAttentionModel``)."""
        return cls(model.attention_maps(tokens), labels, **kwargs)

    @staticmethod
    def _check_attention(attention: object) -> list[torch.Tensor]:
        if isinstance(attention, torch.Tensor):
            attention = [attention]
        if not isinstance(attention, (list, tuple)) or not attention:
            raise TypeError(f"attention must be a tensor (B, H, L, S) or a list of them, got {type(attention).__name__}")
        layers = []
        for index, weights in enumerate(attention):
            if not isinstance(weights, torch.Tensor) or weights.dim() != 4:
                got = shape_str(weights.shape) if isinstance(weights, torch.Tensor) else type(weights).__name__
                raise ValueError(f"layer {index}: expected weights (B, H, L, S), got {got}")
            if weights.shape[0] != attention[0].shape[0]:
                raise ValueError(f"layer {index} has batch {weights.shape[0]}, layer 0 has {attention[0].shape[0]}")
            layers.append(weights.detach().float().cpu())
        return layers

    @staticmethod
    def _check_tokens(tokens: object, B: int) -> list[list[str]] | None:
        if tokens is None:
            return None
        tokens = list(tokens)
        if tokens and isinstance(tokens[0], str):
            return [[str(t) for t in tokens]] * B
        if len(tokens) != B:
            raise ValueError(f"got token labels for {len(tokens)} examples, the weights hold {B}")
        return [[str(t) for t in row] for row in tokens]

    def _head_options(self, layer: int) -> list[tuple[str, int]]:
        return [(f"head {h}", h) for h in range(self.layers[layer].shape[1])]

    def _sync_heads(self, change: dict) -> None:
        options = self._head_options(change["new"])
        if len(options) != len(self.head.options):
            with self.head.hold_trait_notifications():
                self.head.options = options
                self.head.value = 0

    @property
    def state(self) -> dict:
        return {
            "layer": self.layer.value,
            "head": self.head.value,
            "example": self.example.value,
            "all_heads": self.all_heads.value,
        }

    def weights(self, *, layer: int = 0, example: int = 0) -> torch.Tensor:
        """Weights ``(H, L, S)`` of one layer and example, cut to ``max_tokens`` positions."""
        if not 0 <= layer < len(self.layers):
            raise ValueError(f"layer must be in [0, {len(self.layers)}), got {layer}")
        B = self.layers[layer].shape[0]
        if not 0 <= example < B:
            raise ValueError(f"example must be in [0, {B}), got {example}")
        return self.layers[layer][example, :, : self.max_tokens, : self.max_tokens]  # (H, L', S')

    def _labels(self, example: int, L: int, S: int) -> tuple[list[str] | None, list[str] | None]:
        if self.tokens is None:
            return None, None
        labels = self.tokens[example]
        key_labels = labels[: self.max_tokens] if len(labels) == S else None
        query_labels = labels[: self.max_tokens] if len(labels) == L else None
        return query_labels, key_labels

    def draw(self, *, layer: int = 0, head: int = 0, example: int = 0, all_heads: bool = False) -> Figure:
        """One head's heatmap, or every head of the layer in a grid."""
        weights = self.weights(layer=layer, example=example)  # (H, L', S')
        H = weights.shape[0]
        if not 0 <= head < H:
            raise ValueError(f"head must be in [0, {H}), got {head}")
        _, _, L, S = self.layers[layer].shape
        query_labels, key_labels = self._labels(example, L, S)
        note = _cap_note(max(L, S), self.max_tokens)
        if all_heads:
            return plot_heads(
                weights,
                query_labels=query_labels,
                key_labels=key_labels,
                suptitle=f"layer {layer}, example {example}: all {H} heads{note}",
            )
        return plot_attention(
            weights[head],
            query_labels=query_labels,
            key_labels=key_labels,
            title=f"layer {layer}, head {head}, example {example}{note}",
        )


class PatchAttentionExplorer(_Explorer):
    """A Vision Transformer's attention over the image itself (lesson 09).

    Args:
        maps: one ``(B, H, N+1, N+1)`` tensor per layer, as ``VisionTransformer(images,
            need_weights=True)`` returns them: token 0 is the class token, tokens ``1..N`` the
            patches, row by row on a square grid.
        images: the ink ``(B, h, w)`` or ``(B, 1, h, w)`` in ``[0, 1]`` drawn under the weights.
        titles: one short caption per image (e.g. ``"label 3, predicted 5"``); default none.
        save_dir: where "Save PNG" writes.

    Controls: the layer (or ``"rollout"``, :func:`attn_course.vit.attention_rollout` of all the
    layers), the head (or the mean of the heads; the rollout always averages them), the image,
    and the query token (the class token or one patch). Left: the query's weights on the
    patches, drawn over the image (:func:`attn_course.viz.plot_patch_attention`). Right: the
    whole ``(N+1, N+1)`` matrix, the query's row boxed.
    """

    name = "patches"
    MEAN = -1  # the head menu's value for "mean of heads"

    def __init__(
        self,
        maps: Sequence[torch.Tensor],
        images: torch.Tensor,
        *,
        titles: Sequence[str] | None = None,
        save_dir: str | Path = ".",
    ) -> None:
        self.layers = HeadExplorer._check_attention(maps)
        B, H, T, _ = self.layers[0].shape
        side = math.isqrt(T - 1)
        if T < 2 or side * side != T - 1 or any(m.shape != self.layers[0].shape for m in self.layers):
            raise ValueError(
                f"maps must be (B, H, N+1, N+1) per layer with N a square number of patches, got "
                f"{[shape_str(m.shape) for m in self.layers]}"
            )
        if not isinstance(images, torch.Tensor) or images.dim() not in (3, 4) or images.shape[0] != B:
            got = shape_str(images.shape) if isinstance(images, torch.Tensor) else type(images).__name__
            raise ValueError(f"images must be (B, h, w) or (B, 1, h, w) with B = {B} like the maps, got {got}")
        self.images = (images[:, 0] if images.dim() == 4 else images).detach().float().cpu()  # (B, h, w)
        h, w = self.images.shape[1:]
        if h % side or w % side:
            raise ValueError(f"a {side}x{side} grid of patches must tile the {h}x{w} images")
        self.side = side
        self.titles = [str(t) for t in titles] if titles is not None else None
        if self.titles is not None and len(self.titles) != B:
            raise ValueError(f"got {len(self.titles)} titles for {B} images")
        self.rollout = attention_rollout(self.layers)  # (B, N+1, N+1), computed once
        self.layer = widgets.Dropdown(
            options=[(f"layer {i}", i) for i in range(len(self.layers))] + [("rollout (all layers)", "rollout")],
            value=len(self.layers) - 1, description="layer")
        self.head = widgets.Dropdown(options=[("mean of heads", self.MEAN)] + [(f"head {i}", i) for i in range(H)],
                                     value=self.MEAN, description="head")
        self.example = widgets.IntSlider(value=0, min=0, max=B - 1, description="image")
        self.query = widgets.Dropdown(options=[("class token", 0)] + [(f"patch {n}", n + 1) for n in range(T - 1)],
                                      value=0, description="query")
        self.layer.observe(lambda change: setattr(self.head, "disabled", change["new"] == "rollout"), names="value")
        super().__init__([self.layer, self.head, self.example, self.query], save_dir=save_dir)
        self.refresh()

    @property
    def state(self) -> dict:
        return {"layer": self.layer.value, "head": self.head.value, "example": self.example.value,
                "query": self.query.value}

    def weights(self, *, layer: int | str = 0, head: int = MEAN, example: int = 0) -> torch.Tensor:
        """The ``(N+1, N+1)`` matrix shown: one head, the mean of the heads, or the rollout."""
        B = self.images.shape[0]
        if not 0 <= example < B:
            raise ValueError(f"example must be in [0, {B}), got {example}")
        if layer == "rollout":
            return self.rollout[example]  # (N+1, N+1)
        if not isinstance(layer, int) or not 0 <= layer < len(self.layers):
            raise ValueError(f"layer must be 'rollout' or an int in [0, {len(self.layers)}), got {layer!r}")
        H = self.layers[layer].shape[1]
        if head == self.MEAN:
            return self.layers[layer][example].mean(dim=0)  # (N+1, N+1)
        if not 0 <= head < H:
            raise ValueError(f"head must be {self.MEAN} (mean) or in [0, {H}), got {head}")
        return self.layers[layer][example, head]  # (N+1, N+1)

    def on_image(self, *, layer: int | str = 0, head: int = MEAN, example: int = 0, query: int = 0) -> torch.Tensor:
        """Row ``query`` of :meth:`weights` over the patches, on the patch grid ``(side, side)``."""
        matrix = self.weights(layer=layer, head=head, example=example)
        if not 0 <= query < matrix.shape[0]:
            raise ValueError(f"query must be a token index in [0, {matrix.shape[0]}), got {query}")
        return matrix[query, 1:].reshape(self.side, self.side)  # (side, side), row by row

    def draw(self, *, layer: int | str = 0, head: int = MEAN, example: int = 0, query: int = 0) -> Figure:
        """Left: the query's weights over the image. Right: the whole matrix, the query's row boxed."""
        matrix = self.weights(layer=layer, head=head, example=example)  # (N+1, N+1)
        grid = self.on_image(layer=layer, head=head, example=example, query=query)  # (side, side)
        which = ("rollout" if layer == "rollout" else
                 f"layer {layer}, " + ("mean of heads" if head == self.MEAN else f"head {head}"))
        who = "class token" if query == 0 else f"patch {query - 1}"
        # Fixed axes positions instead of a layout engine: redrawing stays quick (lesson 09's widget).
        fig = Figure(figsize=(9.0, 4.2))
        left = fig.add_axes((0.03, 0.2, 0.38, 0.64))
        right = fig.add_axes((0.52, 0.14, 0.36, 0.7))
        top = float(matrix.max())  # one colour scale for both panels
        plot_patch_attention(self.images[example], grid, ax=left, outline=None if query == 0 else query - 1, vmax=top,
                             title=f"{who} -> patches (keeps {matrix[query, 0]:.2f} on the class token)")
        labels = ["cls"] + [str(n) for n in range(matrix.shape[0] - 1)]
        plot_attention(matrix, ax=right, query_labels=labels, key_labels=labels, vmax=top, title=which, colorbar=False,
                       cmap="magma")
        right.tick_params(labelsize=7)
        right.add_patch(Rectangle((-0.5, query - 0.5), matrix.shape[1], 1, fill=False, edgecolor="white", linewidth=1.5))
        fig.colorbar(right.images[0], cax=fig.add_axes((0.9, 0.14, 0.015, 0.7)), label="weight")
        # The left panel's own colourbar: the same scale (0 to the matrix's largest weight) as the right.
        fig.colorbar(left.images[0], cax=fig.add_axes((0.08, 0.09, 0.28, 0.025)), orientation="horizontal",
                     label="weight (same scale as the matrix)")
        caption = f"image {example}" + (f": {self.titles[example]}" if self.titles else "")
        fig.suptitle(f"{caption} ({which})")
        return fig


class ScaleExplorer(_Explorer):
    """Random queries and keys with unit-variance entries: watch the scores and the softmax.

    Controls: the head dim ``d_k``, whether scores are divided by ``sqrt(d_k)``, and a
    temperature ``T`` (scores are divided by ``T`` as well). Query and key entries are drawn
    once (seeded) at ``max_d_k``; a smaller ``d_k`` uses their first ``d_k`` columns.
    """

    name = "scale"

    def __init__(
        self,
        *,
        length: int = 12,
        d_k: int = 64,
        scaled: bool = False,
        temperature: float = 1.0,
        max_d_k: int = 1024,
        seed: int = 0,
        save_dir: str | Path = ".",
    ) -> None:
        self.length = _check_cap(length, what="length")
        check_positive_int("max_d_k", max_d_k)
        self.d_k_options = [2**i for i in range(int(math.log2(max_d_k)) + 1)]
        generator = torch.Generator().manual_seed(seed)
        self.q = torch.randn(self.length, self.d_k_options[-1], generator=generator, dtype=torch.float64)  # (L, D)
        self.k = torch.randn(self.length, self.d_k_options[-1], generator=generator, dtype=torch.float64)  # (S, D)
        self._check_state(d_k, temperature)
        self.d_k = widgets.SelectionSlider(options=self.d_k_options, value=d_k, description="d_k")
        self.scaled = widgets.Checkbox(value=scaled, description="divide by sqrt(d_k)")
        self.temperature = widgets.FloatLogSlider(value=temperature, base=10, min=-1, max=1, step=0.05, description="temperature")
        super().__init__([self.d_k, self.scaled, self.temperature], save_dir=save_dir)
        self.refresh()

    def _check_state(self, d_k: int, temperature: float) -> None:
        if d_k not in self.d_k_options:
            raise ValueError(f"d_k must be one of {self.d_k_options}, got {d_k!r}")
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")

    @property
    def state(self) -> dict:
        return {"d_k": self.d_k.value, "scaled": self.scaled.value, "temperature": self.temperature.value}

    def scale(self, *, d_k: int, scaled: bool, temperature: float = 1.0) -> float:
        """The factor the scores ``q @ k^T`` are multiplied by."""
        self._check_state(d_k, temperature)
        return (1.0 / math.sqrt(d_k) if scaled else 1.0) / temperature

    def scores(self, *, d_k: int, scaled: bool, temperature: float = 1.0) -> torch.Tensor:
        """Scaled scores ``(L, S)`` as the softmax sees them."""
        factor = self.scale(d_k=d_k, scaled=scaled, temperature=temperature)
        return (self.q[:, :d_k] @ self.k[:, :d_k].T) * factor  # (L, S)

    def weights(self, *, d_k: int, scaled: bool, temperature: float = 1.0) -> torch.Tensor:
        """Attention weights ``(L, S)``, from the library's ``scaled_dot_product_attention``."""
        factor = self.scale(d_k=d_k, scaled=scaled, temperature=temperature)
        q, k = self.q[:, :d_k], self.k[:, :d_k]  # (L, D), (S, D)
        _, weights = scaled_dot_product_attention(q, k, k, scale=factor, need_weights=True)  # (L, S)
        return weights

    def stats(self, *, d_k: int, scaled: bool, temperature: float = 1.0) -> dict[str, float]:
        """Spread of the scores and sharpness of the softmax: std, mean max weight, mean entropy."""
        scores = self.scores(d_k=d_k, scaled=scaled, temperature=temperature)
        weights = self.weights(d_k=d_k, scaled=scaled, temperature=temperature)
        entropy = -(weights * weights.clamp_min(1e-300).log()).sum(-1)  # (L,), in nats
        return {
            "score_std": scores.std().item(),
            "max_weight": weights.amax(-1).mean().item(),
            "entropy": entropy.mean().item(),
            "uniform_entropy": math.log(self.length),
        }

    def draw(self, *, d_k: int = 64, scaled: bool = False, temperature: float = 1.0) -> Figure:
        """Left: the weights as a heatmap. Right: the histogram of the scores."""
        scores = self.scores(d_k=d_k, scaled=scaled, temperature=temperature)
        weights = self.weights(d_k=d_k, scaled=scaled, temperature=temperature)
        s = self.stats(d_k=d_k, scaled=scaled, temperature=temperature)
        fig = Figure(figsize=(9.5, 3.8), layout="constrained")
        left, right = fig.subplots(1, 2, width_ratios=[1.1, 1])
        how = "q·k / sqrt(d_k)" if scaled else "q·k (no scale)"
        plot_attention(weights, ax=left, title=f"weights: mean max {s['max_weight']:.2f}")
        right.hist(scores.flatten().numpy(), bins=30, color="#2c7fb8")
        right.set_xlabel(f"score = {how}" + (f" / T (T = {temperature:.2g})" if temperature != 1.0 else ""))
        right.set_ylabel("count")
        right.set_title(f"score std {s['score_std']:.2f}")
        fig.suptitle(
            f"d_k = {d_k}: entropy {s['entropy']:.2f} nats (uniform would be {s['uniform_entropy']:.2f})"
        )
        return fig


class MaskExplorer(_Explorer):
    """Causal, padding and combined masks for one sequence, and the weights they leave.

    ``valid_length`` real tokens are followed by padding up to ``length`` (or, for the kind
    ``"causal + left padding"``, preceded by it). The padding mask blocks padded *keys* (every
    query, padded or not, may still read the real tokens it is allowed to). With
    ``valid_length = 0`` every row is fully masked, and with left padding under a causal mask
    the padding queries are: the library returns zero weights there. Used in lesson 03.
    """

    name = "mask"
    KINDS = ("none", "causal", "padding", "causal + padding", "causal + left padding")

    def __init__(
        self,
        *,
        kind: str = "causal + padding",
        length: int = 8,
        valid_length: int = 6,
        max_tokens: int = MAX_TOKENS,
        seed: int = 0,
        save_dir: str | Path = ".",
    ) -> None:
        self.max_tokens = _check_cap(max_tokens)
        self._check_state(kind, length, valid_length)
        generator = torch.Generator().manual_seed(seed)
        self.q = torch.randn(self.max_tokens, 8, generator=generator, dtype=torch.float64)  # (L, D)
        self.k = torch.randn(self.max_tokens, 8, generator=generator, dtype=torch.float64)  # (S, D)
        self.kind = widgets.ToggleButtons(options=self.KINDS, value=kind, description="mask")
        self.length = widgets.IntSlider(value=length, min=1, max=self.max_tokens, description="length")
        self.valid_length = widgets.IntSlider(value=valid_length, min=0, max=length, description="real tokens")
        # Keep "real tokens" <= "length" before the redraw triggered by the length change.
        self.length.observe(self._sync_valid_length, names="value")
        super().__init__([self.kind, self.length, self.valid_length], save_dir=save_dir)
        self.refresh()

    def _check_state(self, kind: str, length: int, valid_length: int) -> None:
        if kind not in self.KINDS:
            raise ValueError(f"kind must be one of {self.KINDS}, got {kind!r}")
        if isinstance(length, bool) or not isinstance(length, int) or not 1 <= length <= self.max_tokens:
            raise ValueError(f"length must be an int in [1, {self.max_tokens}] (the drawing cap), got {length!r}")
        if isinstance(valid_length, bool) or not isinstance(valid_length, int) or not 0 <= valid_length <= length:
            raise ValueError(f"valid_length must be an int in [0, length={length}], got {valid_length!r}")

    def _sync_valid_length(self, change: dict) -> None:
        with self.valid_length.hold_trait_notifications():
            self.valid_length.max = change["new"]  # ipywidgets clamps the value to the new max

    @property
    def state(self) -> dict:
        return {"kind": self.kind.value, "length": self.length.value, "valid_length": self.valid_length.value}

    def mask(self, *, kind: str, length: int, valid_length: int) -> torch.Tensor:
        """The boolean mask ``(L, S)``, True = may attend, built with ``attn_course.masks``."""
        self._check_state(kind, length, valid_length)
        everything = torch.ones(length, length, dtype=torch.bool)  # (L, S)
        causal = causal_mask(length) if "causal" in kind else None  # (L, S)
        padding = padding_mask([valid_length], length) if "padding" in kind else None  # (1, S)
        if "left padding" in kind:
            padding = padding.flip(-1)  # (1, S): the real tokens are the last valid_length positions
        return combine_masks(everything, causal, padding)  # (L, S)

    def weights(self, *, kind: str, length: int, valid_length: int) -> torch.Tensor:
        """Weights ``(L, S)`` of seeded random scores under the mask (library attention)."""
        mask = self.mask(kind=kind, length=length, valid_length=valid_length)
        q, k = self.q[:length], self.k[:length]  # (L, D), (S, D)
        _, weights = scaled_dot_product_attention(q, k, k, mask, need_weights=True)  # (L, S)
        return weights

    def draw(self, *, kind: str = "causal + padding", length: int = 8, valid_length: int = 6) -> Figure:
        """Left: the mask. Right: the attention weights it leaves."""
        mask = self.mask(kind=kind, length=length, valid_length=valid_length)
        weights = self.weights(kind=kind, length=length, valid_length=valid_length)
        empty = int((~mask.any(-1)).sum())
        first_real = length - valid_length if "left padding" in kind else 0
        labels = [str(i) if first_real <= i < first_real + valid_length else f"{i}·" for i in range(length)]
        fig = Figure(figsize=(9.5, 4.0), layout="constrained")
        left, right = fig.subplots(1, 2)
        plot_mask(mask, ax=left, query_labels=labels, key_labels=labels, title=f"{kind} mask: blue = may attend")
        plot_attention(
            weights,
            ax=right,
            query_labels=labels,
            key_labels=labels,
            title=f"weights ({empty} fully-masked rows -> all zero)" if empty else "weights (every row sums to 1)",
        )
        fig.suptitle(f"{length} positions, {valid_length} real tokens (· = padding)")
        return fig


def _check_cap(value: int, *, what: str = "max_tokens") -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_TOKENS:
        raise ValueError(f"{what} must be an int in [1, {MAX_TOKENS}] (the drawing cap), got {value!r}")
    return value


class PatternExplorer(_Explorer):
    """Sparse attention patterns (lesson 05): which keys each query may attend to, and how many.

    Controls: the pattern (``"block"``, ``"sliding"``, ``"strided"``), its size (the block
    length, the window radius or the stride -- the slider's label follows the pattern), the
    number of global tokens, causal or not, and the sequence length. Left: the boolean mask
    from :func:`attn_course.sparse.pattern_mask` (the one ``sparse_attention`` equals). Right:
    the number of keys each query attends to, against dense attention's. The title gives the
    density: the fraction of the ``L x L`` (or, causal, the lower-triangle) pairs computed.
    """

    name = "pattern"
    SIZE_LABELS = {"block": "block size", "sliding": "window ±", "strided": "stride"}

    def __init__(
        self,
        *,
        pattern: str = "sliding",
        length: int = 32,
        size: int = 4,
        num_global: int = 0,
        is_causal: bool = False,
        save_dir: str | Path = ".",
    ) -> None:
        self._check_state(pattern, length, size, num_global)
        self.pattern = widgets.Dropdown(options=list(PATTERNS), value=pattern, description="pattern")
        self.size = widgets.IntSlider(value=size, min=1, max=MAX_TOKENS, description=self.SIZE_LABELS[pattern])
        self.num_global = widgets.IntSlider(value=num_global, min=0, max=8, description="global tokens")
        self.is_causal = widgets.Checkbox(value=is_causal, description="causal")
        self.length = widgets.IntSlider(value=length, min=1, max=MAX_TOKENS, description="length")
        self.pattern.observe(self._sync_size_label, names="value")
        super().__init__([self.pattern, self.size, self.num_global, self.is_causal, self.length], save_dir=save_dir)
        self.refresh()

    def _check_state(self, pattern: str, length: int, size: int, num_global: int) -> None:
        if pattern not in PATTERNS:
            raise ValueError(f"pattern must be one of {PATTERNS}, got {pattern!r}")
        _check_cap(length, what="length")
        _check_cap(size, what="size")
        check_int("num_global", num_global, minimum=0)

    def _sync_size_label(self, change: dict) -> None:
        self.size.description = self.SIZE_LABELS[change["new"]]

    @property
    def state(self) -> dict:
        return {
            "pattern": self.pattern.value,
            "length": self.length.value,
            "size": self.size.value,
            "num_global": self.num_global.value,
            "is_causal": self.is_causal.value,
        }

    def mask(self, *, pattern: str, length: int, size: int, num_global: int = 0, is_causal: bool = False) -> torch.Tensor:
        """The boolean ``(L, L)`` mask, True = may attend (``attn_course.sparse.pattern_mask``)."""
        self._check_state(pattern, length, size, num_global)
        return pattern_mask(length, pattern=pattern, size=size, num_global=num_global, is_causal=is_causal)

    def density(self, *, pattern: str, length: int, size: int, num_global: int = 0, is_causal: bool = False) -> dict:
        """Pairs computed: ``allowed`` of the pattern, ``dense`` of full (or causal) attention, their ratio."""
        allowed = int(self.mask(pattern=pattern, length=length, size=size, num_global=num_global,
                                is_causal=is_causal).sum())
        dense = length * (length + 1) // 2 if is_causal else length * length
        return {"allowed": allowed, "dense": dense, "fraction": allowed / dense}

    def draw(
        self, *, pattern: str = "sliding", length: int = 32, size: int = 4, num_global: int = 0, is_causal: bool = False
    ) -> Figure:
        """Left: the mask. Right: keys attended per query, sparse against dense."""
        mask = self.mask(pattern=pattern, length=length, size=size, num_global=num_global, is_causal=is_causal)
        stats = self.density(pattern=pattern, length=length, size=size, num_global=num_global, is_causal=is_causal)
        per_query = mask.sum(dim=-1)  # (L,), keys each query attends to
        dense = torch.arange(1, length + 1) if is_causal else torch.full((length,), length)  # (L,)
        fig = Figure(figsize=(10.0, 4.2), layout="constrained")
        left, right = fig.subplots(1, 2, width_ratios=[1.1, 1])
        how = {"block": f"blocks of {size}", "sliding": f"window ±{size}", "strided": f"window ±{size}, stride {size}"}
        extras = (f", {min(num_global, length)} global" if num_global else "") + (", causal" if is_causal else "")
        plot_mask(mask, ax=left, title=f"{pattern}: {how[pattern]}{extras}")
        positions = torch.arange(length)
        right.bar(positions.numpy(), per_query.numpy(), color="#2c7fb8", width=0.9, label="sparse pattern")
        right.step(positions.numpy(), dense.numpy(), where="mid", color="grey", linestyle=":",
                   label="causal attention" if is_causal else "dense attention")
        right.set_xlabel("query position")
        right.set_ylabel("keys attended")
        right.set_ylim(0, 1.15 * length + 0.5)  # headroom, so the dense line is visible
        right.legend(loc="best", fontsize="small")
        right.set_title(f"{stats['allowed']} of {stats['dense']} pairs")
        fig.suptitle(f"{length} positions: the pattern computes {stats['fraction']:.1%} of "
                     f"{'causal' if is_causal else 'dense'} attention's score pairs")
        return fig
