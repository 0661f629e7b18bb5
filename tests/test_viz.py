"""viz: each helper draws exactly the data it is given, with labels, and rejects bad input."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from matplotlib.figure import Figure

import attn_course as ac
from attn_course.viz import MAX_TOKENS, figure_to_png, plot_attention, plot_heads, plot_mask


def _weights(H: int, L: int, S: int) -> torch.Tensor:
    return torch.softmax(torch.randn(H, L, S, generator=torch.Generator().manual_seed(0)), dim=-1)  # (H, L, S)


def test_plot_attention_draws_the_weights_with_token_labels():
    w = _weights(1, 4, 5)[0]  # (L, S)
    fig = plot_attention(w, query_labels=list("abcd"), key_labels=list("vwxyz"), title="one head")
    assert isinstance(fig, Figure)
    ax = fig.axes[0]
    np.testing.assert_allclose(ax.images[0].get_array(), w.numpy())
    assert [t.get_text() for t in ax.get_xticklabels()] == list("vwxyz")
    assert [t.get_text() for t in ax.get_yticklabels()] == list("abcd")
    assert ax.get_title() == "one head"
    assert ax.images[0].get_clim() == (0.0, 1.0), "weights share one fixed colour scale by default"
    assert len(fig.axes) == 2, "heatmap + colorbar"


def test_plot_attention_draws_on_a_given_axes():
    fig = Figure()
    ax = fig.add_subplot()
    assert plot_attention(_weights(1, 3, 3)[0], ax=ax, colorbar=False) is fig
    assert len(fig.axes) == 1


def test_plot_attention_skips_labels_for_long_inputs():
    w = _weights(1, 50, 50)[0]
    ax = plot_attention(w, query_labels=[str(i) for i in range(50)], key_labels=[str(i) for i in range(50)]).axes[0]
    assert "49" not in [t.get_text() for t in ax.get_xticklabels()], "50 labels would overlap: numbers only"


def test_plot_heads_draws_every_head_in_order():
    w = _weights(6, 4, 4)
    fig = plot_heads(w, ncols=4, suptitle="all heads")
    heat = [ax for ax in fig.axes if ax.images]
    assert len(heat) == 6
    for h, ax in enumerate(heat):
        np.testing.assert_allclose(ax.images[0].get_array(), w[h].numpy())
        assert ax.get_title() == f"head {h}"
    assert sum(not ax.axison for ax in fig.axes) == 2, "the 2 unused cells of the 2x4 grid are blank"


def test_plot_mask_draws_the_mask_in_may_attend_polarity():
    mask = ac.causal_mask(5)
    ax = plot_mask(mask).axes[0]
    np.testing.assert_array_equal(ax.images[0].get_array(), mask.numpy())
    assert "may attend" in ax.get_title()


def test_bad_inputs_raise_with_the_expected_shape():
    with pytest.raises(ValueError, match=r"2-D \(L, S\).*\(2, 3, 3\)"):
        plot_attention(_weights(2, 3, 3))
    with pytest.raises(TypeError, match="floating point"):
        plot_attention(ac.causal_mask(3))
    with pytest.raises(TypeError, match="boolean mask"):
        plot_mask(torch.ones(3, 3))
    with pytest.raises(ValueError, match="3 labels for 4 positions"):
        plot_attention(_weights(1, 4, 4)[0], key_labels=list("abc"))
    with pytest.raises(ValueError, match=r"\(H, L, S\)"):
        plot_heads(_weights(1, 4, 4)[0])


def test_figure_to_png_is_a_png():
    png = figure_to_png(plot_attention(_weights(1, 3, 3)[0]))
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 1000


def test_max_tokens_is_the_documented_cap():
    assert MAX_TOKENS == 64


def test_plot_patch_attention_puts_each_weight_on_its_patch():
    from attn_course.viz import plot_patch_attention

    weights = torch.arange(16.0).reshape(4, 4) / 16  # (gh, gw): patch n = r * 4 + c has weight n / 16
    ink = torch.zeros(8, 8)
    ink[2:6, 3:5] = 1.0
    fig = plot_patch_attention(ink, weights, outline=6, title="patch 6")
    ax = fig.axes[0]
    np.testing.assert_allclose(ax.images[0].get_array(), weights.numpy())
    assert tuple(ax.images[0].get_extent()) == (0, 8, 8, 0), "the 4 x 4 grid covers the 8 x 8 image"
    box = ax.patches[0]
    assert (box.get_x(), box.get_y(), box.get_width(), box.get_height()) == (4, 2, 2, 2)  # row 1, column 2
    assert ax.get_title() == "patch 6"
    with pytest.raises(ValueError, match="tile"):
        plot_patch_attention(torch.zeros(8, 8), torch.ones(3, 3))
    with pytest.raises(ValueError, match="outline"):
        plot_patch_attention(ink, weights, outline=16)
