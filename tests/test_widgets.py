"""Widgets: drive each control, check the drawn data follows it, the PNG export, and the size cap."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import attn_course as ac
from attn_course.models import TinyAttentionConfig, TinyAttentionModel
from attn_course.viz import MAX_TOKENS
from attn_course.widgets import HeadExplorer, MaskExplorer, ScaleExplorer

PNG = b"\x89PNG\r\n\x1a\n"


def _drawn(explorer, index: int = 0) -> np.ndarray:
    """The array of the index-th heatmap in the explorer's current figure."""
    heatmaps = [ax for ax in explorer.figure.axes if ax.images]
    return np.asarray(heatmaps[index].images[0].get_array())


def _layers(B=3, H=(2, 4), L=5, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.softmax(torch.randn(B, h, L, L, generator=gen), dim=-1) for h in H]  # per layer (B, H, L, L)


# --- head explorer --------------------------------------------------------------------------


def test_head_explorer_follows_head_example_and_layer():
    layers = _layers()
    explorer = HeadExplorer(layers, list("abcde"))
    np.testing.assert_allclose(_drawn(explorer), layers[0][0, 0].numpy())
    png = bytes(explorer.image.value)
    assert png.startswith(PNG)

    explorer.head.value = 1
    np.testing.assert_allclose(_drawn(explorer), layers[0][0, 1].numpy())
    assert bytes(explorer.image.value) != png, "the live image is redrawn"

    explorer.example.value = 2
    np.testing.assert_allclose(_drawn(explorer), layers[0][2, 1].numpy())

    explorer.layer.value = 1  # 4 heads there: the head menu grows and resets to head 0
    assert [v for _, v in explorer.head.options] == [0, 1, 2, 3]
    np.testing.assert_allclose(_drawn(explorer), layers[1][2, 0].numpy())
    explorer.head.value = 3
    np.testing.assert_allclose(_drawn(explorer), layers[1][2, 3].numpy())
    assert explorer.state == {"layer": 1, "head": 3, "example": 2, "all_heads": False}


def test_head_explorer_all_heads_grid_and_token_labels():
    layers = _layers()
    explorer = HeadExplorer(layers, [list("abcde"), list("fghij"), list("klmno")])
    explorer.example.value = 1
    explorer.all_heads.value = True
    heatmaps = [ax for ax in explorer.figure.axes if ax.images]
    assert len(heatmaps) == 2
    for h in range(2):
        np.testing.assert_allclose(_drawn(explorer, h), layers[0][1, h].numpy())
    assert [t.get_text() for t in heatmaps[0].get_xticklabels()] == list("fghij")


def test_head_explorer_draw_is_the_plain_method_behind_the_view():
    layers = _layers()
    explorer = HeadExplorer(layers)
    fig = explorer.draw(layer=1, head=2, example=1)
    np.testing.assert_allclose(fig.axes[0].images[0].get_array(), layers[1][1, 2].numpy())
    assert "layer 1, head 2, example 1" in fig.axes[0].get_title()
    with pytest.raises(ValueError, match=r"head must be in \[0, 2\)"):
        explorer.draw(layer=0, head=3)


def test_head_explorer_save_button_writes_a_png(tmp_path):
    explorer = HeadExplorer(_layers(), save_dir=tmp_path)
    explorer.head.value = 1
    explorer.save_button.click()
    written = list(tmp_path.glob("*.png"))
    assert len(written) == 1 and written[0].read_bytes().startswith(PNG)
    assert "head1" in written[0].name and str(written[0]) in explorer.status.value
    chosen = explorer.save_png(tmp_path / "sub" / "mine.png")
    assert chosen.read_bytes().startswith(PNG)


def test_head_explorer_caps_long_inputs():
    L = 100
    weights = torch.softmax(torch.randn(1, 2, L, L), dim=-1)  # (B, H, L, S)
    explorer = HeadExplorer(weights, [str(i) for i in range(L)])
    drawn = _drawn(explorer)
    assert drawn.shape == (MAX_TOKENS, MAX_TOKENS)
    np.testing.assert_allclose(drawn, weights[0, 0, :MAX_TOKENS, :MAX_TOKENS].numpy())
    assert f"first {MAX_TOKENS} of {L}" in explorer.figure.axes[0].get_title()
    assert HeadExplorer(weights, max_tokens=16).weights().shape == (2, 16, 16)
    with pytest.raises(ValueError, match="drawing cap"):
        HeadExplorer(weights, max_tokens=MAX_TOKENS + 1)


def test_head_explorer_from_model_shows_the_model_weights():
    torch.manual_seed(0)
    model = TinyAttentionModel(TinyAttentionConfig(vocab_size=5, num_classes=3, max_len=8, num_layers=2))
    tokens = torch.randint(0, 5, (2, 6))
    explorer = HeadExplorer.from_model(model, tokens)
    explorer.layer.value = 1
    explorer.head.value = 1
    np.testing.assert_allclose(_drawn(explorer), model.attention_maps(tokens)[1][0, 1].numpy(), rtol=1e-6)


def test_head_explorer_rejects_bad_input():
    with pytest.raises(ValueError, match=r"\(B, H, L, S\)"):
        HeadExplorer(torch.rand(2, 3, 3))
    with pytest.raises(ValueError, match="labels for 2 examples"):
        HeadExplorer(_layers(B=3), [list("abcde")] * 2)


# --- scale explorer -------------------------------------------------------------------------


def test_scale_explorer_weights_follow_d_k_scale_and_temperature():
    explorer = ScaleExplorer(length=6, d_k=16, scaled=False, max_d_k=256)
    q, k = explorer.q, explorer.k

    def expected(d_k, factor):
        return torch.softmax((q[:, :d_k] @ k[:, :d_k].T) * factor, dim=-1).numpy()

    np.testing.assert_allclose(_drawn(explorer), expected(16, 1.0), rtol=1e-6, atol=1e-12)
    explorer.d_k.value = 256
    np.testing.assert_allclose(_drawn(explorer), expected(256, 1.0), rtol=1e-6, atol=1e-12)
    explorer.scaled.value = True
    np.testing.assert_allclose(_drawn(explorer), expected(256, 1 / 16), rtol=1e-6, atol=1e-12)
    explorer.temperature.value = 10.0
    np.testing.assert_allclose(_drawn(explorer), expected(256, 1 / 160), rtol=1e-6, atol=1e-12)
    assert "d_k = 256" in explorer.figure.get_suptitle()


def test_scale_explorer_stats_show_the_effect_of_the_scale():
    explorer = ScaleExplorer(length=32, max_d_k=1024, seed=1)
    raw = explorer.stats(d_k=1024, scaled=False)
    scaled = explorer.stats(d_k=1024, scaled=True)
    assert 20 < raw["score_std"] < 45, "unscaled scores spread like sqrt(d_k) = 32"
    assert 0.7 < scaled["score_std"] < 1.4, "scaled scores keep a spread near 1"
    assert raw["max_weight"] > 0.9 > scaled["max_weight"], "without the scale the softmax saturates"
    assert raw["entropy"] < scaled["entropy"] < scaled["uniform_entropy"] == pytest.approx(math.log(32))


def test_scale_explorer_weights_match_torch_sdpa():
    explorer = ScaleExplorer(length=5, max_d_k=64)
    q, k = explorer.q[:, :64], explorer.k[:, :64]
    eye = torch.eye(5, dtype=q.dtype)  # values = identity, so the output equals the weights
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, eye, scale=1 / 8 / 2.0)
    torch.testing.assert_close(explorer.weights(d_k=64, scaled=True, temperature=2.0), expected)


def test_scale_explorer_rejects_bad_state():
    explorer = ScaleExplorer(max_d_k=64)
    with pytest.raises(ValueError, match="d_k must be one of"):
        explorer.draw(d_k=48)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        explorer.weights(d_k=4, scaled=True, temperature=0.0)
    with pytest.raises(ValueError, match="drawing cap"):
        ScaleExplorer(length=MAX_TOKENS + 1)


# --- mask explorer --------------------------------------------------------------------------


def test_mask_explorer_draws_each_kind_of_mask():
    explorer = MaskExplorer(kind="none", length=6, valid_length=4)
    np.testing.assert_array_equal(_drawn(explorer, 0), np.ones((6, 6), dtype=bool))
    explorer.kind.value = "causal"
    np.testing.assert_array_equal(_drawn(explorer, 0), ac.causal_mask(6).numpy())
    explorer.kind.value = "padding"
    padding = ac.padding_mask([4], 6).expand(6, 6)  # (L, S): every query may read keys 0..3
    np.testing.assert_array_equal(_drawn(explorer, 0), padding.numpy())
    explorer.kind.value = "causal + padding"
    np.testing.assert_array_equal(_drawn(explorer, 0), (ac.causal_mask(6) & padding).numpy())


def test_mask_explorer_weights_obey_the_mask():
    explorer = MaskExplorer(kind="causal + padding", length=6, valid_length=4)
    mask = torch.as_tensor(_drawn(explorer, 0))
    weights = torch.as_tensor(_drawn(explorer, 1))
    assert (weights[~mask] == 0).all()
    torch.testing.assert_close(weights.sum(-1), torch.ones(6, dtype=weights.dtype))
    explorer.valid_length.value = 0  # nothing real to attend to: every row is fully masked
    assert not _drawn(explorer, 0).any()
    assert (_drawn(explorer, 1) == 0).all(), "fully-masked rows give zero weights, not NaN"
    assert "6 fully-masked rows" in [ax for ax in explorer.figure.axes if ax.images][1].get_title()


def test_mask_explorer_left_padding_empties_exactly_the_padding_queries():
    explorer = MaskExplorer(kind="causal + left padding", length=6, valid_length=4)
    mask = torch.as_tensor(_drawn(explorer, 0))  # (L, S): positions 0, 1 are padding, 2..5 real
    real = torch.tensor([False, False, True, True, True, True])
    torch.testing.assert_close(mask, ac.causal_mask(6) & real)
    assert (~mask.any(-1)).tolist() == (~real).tolist(), "the empty rows are the padding queries"
    assert mask[2].nonzero().flatten().tolist() == [2], "the first real query sees itself"
    weights = torch.as_tensor(_drawn(explorer, 1))
    assert (weights[:2] == 0).all() and torch.allclose(weights[2:].sum(-1), torch.ones(4, dtype=weights.dtype))
    assert "2 fully-masked rows" in [ax for ax in explorer.figure.axes if ax.images][1].get_title()


def test_mask_explorer_length_slider_resizes_and_clamps_real_tokens():
    explorer = MaskExplorer(kind="causal + padding", length=8, valid_length=6)
    explorer.length.value = 4
    assert explorer.valid_length.value == 4 and explorer.valid_length.max == 4
    np.testing.assert_array_equal(_drawn(explorer, 0), ac.causal_mask(4).numpy())
    explorer.length.value = 20
    assert _drawn(explorer, 0).shape == (20, 20)


def test_mask_explorer_caps_the_length(tmp_path):
    explorer = MaskExplorer(save_dir=tmp_path)
    assert explorer.length.max == MAX_TOKENS
    with pytest.raises(ValueError, match="drawing cap"):
        explorer.draw(length=MAX_TOKENS + 1, valid_length=3)
    with pytest.raises(ValueError, match="drawing cap"):
        MaskExplorer(length=100, valid_length=3)
    with pytest.raises(ValueError, match="kind must be one of"):
        explorer.mask(kind="future", length=4, valid_length=4)
    explorer.save_button.click()
    assert next(tmp_path.glob("mask_*.png")).read_bytes().startswith(PNG)


def test_displaying_an_explorer_displays_its_ui(monkeypatch):
    import IPython.display

    shown = []
    monkeypatch.setattr(IPython.display, "display", lambda *objects, **kwargs: shown.extend(objects))
    explorer = MaskExplorer()
    explorer._ipython_display_()
    assert shown == [explorer.ui]
    assert explorer.image in explorer.ui.children


# --- pattern explorer (lesson 05) -----------------------------------------------------------


def test_pattern_explorer_follows_every_control():
    from attn_course.sparse import pattern_mask
    from attn_course.widgets import PatternExplorer

    explorer = PatternExplorer(pattern="sliding", length=16, size=2)
    np.testing.assert_array_equal(_drawn(explorer), pattern_mask(16, pattern="sliding", size=2).numpy())
    png = bytes(explorer.image.value)
    assert png.startswith(PNG)

    explorer.pattern.value = "block"
    assert explorer.size.description == "block size"
    np.testing.assert_array_equal(_drawn(explorer), pattern_mask(16, pattern="block", size=2).numpy())
    assert bytes(explorer.image.value) != png, "the live image is redrawn"
    explorer.size.value = 5  # 16 = 3 blocks of 5 + 1: the last block is shorter
    np.testing.assert_array_equal(_drawn(explorer), pattern_mask(16, pattern="block", size=5).numpy())
    explorer.num_global.value = 2
    explorer.is_causal.value = True
    expected = pattern_mask(16, pattern="block", size=5, num_global=2, is_causal=True)
    np.testing.assert_array_equal(_drawn(explorer), expected.numpy())
    explorer.pattern.value = "strided"
    explorer.length.value = 40
    expected = pattern_mask(40, pattern="strided", size=5, num_global=2, is_causal=True)
    np.testing.assert_array_equal(_drawn(explorer), expected.numpy())
    assert explorer.size.description == "stride"
    assert explorer.state == {"pattern": "strided", "length": 40, "size": 5, "num_global": 2, "is_causal": True}

    # The bars on the right are the keys each query attends to; the title gives the density.
    bars = [patch.get_height() for patch in explorer.figure.axes[1].patches]
    assert bars == expected.sum(-1).tolist()
    stats = explorer.density(**explorer.state)
    assert stats == {"allowed": int(expected.sum()), "dense": 40 * 41 // 2, "fraction": int(expected.sum()) / 820}
    assert f"{stats['fraction']:.1%}" in explorer.figure.get_suptitle()


def test_pattern_explorer_density_of_known_patterns_and_bad_state(tmp_path):
    from attn_course.widgets import PatternExplorer

    explorer = PatternExplorer(save_dir=tmp_path)
    assert explorer.density(pattern="block", length=12, size=4)["allowed"] == 3 * 4 * 4
    assert explorer.density(pattern="block", length=12, size=12)["fraction"] == 1.0
    causal_full = explorer.density(pattern="sliding", length=10, size=10, is_causal=True)
    assert causal_full["fraction"] == 1.0 and causal_full["dense"] == 55
    with pytest.raises(ValueError, match="pattern must be one of"):
        explorer.draw(pattern="random")
    with pytest.raises(ValueError, match="drawing cap"):
        explorer.mask(pattern="block", length=MAX_TOKENS + 1, size=4)
    explorer.save_button.click()
    assert next(tmp_path.glob("pattern_*.png")).read_bytes().startswith(PNG)
