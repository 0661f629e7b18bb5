"""Vision Transformer: patches, shapes, gradients, config fields, attention maps, rollout, and
the token-mixing probe that catches the source article's ViT attention bug."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn as nn

from attn_course.diagnostics import token_influence
from attn_course.multihead import MultiHeadAttention
from attn_course.positional import LearnedPositionalEmbedding
from attn_course.vit import (
    PatchEmbedding,
    ViTBlock,
    ViTConfig,
    VisionTransformer,
    attention_rollout,
    patchify,
    sincos_positions_2d,
)

SMALL = ViTConfig(image_size=8, patch_size=4, in_channels=1, num_classes=3, d_model=16, depth=2, num_heads=2)


def small_model(config: ViTConfig = SMALL, *, dtype=torch.float64, device="cpu") -> VisionTransformer:
    torch.manual_seed(0)
    return VisionTransformer(config, dtype=dtype, device=device).eval()


def images_for(config: ViTConfig, batch: int = 2, *, dtype=torch.float64) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1)
    return torch.randn(batch, config.in_channels, config.image_size, config.image_size, generator=gen, dtype=dtype)


# ---------------------------------------------------------------- patches


def test_patchify_cuts_row_by_row():
    images = torch.arange(2 * 4 * 4, dtype=torch.float32).reshape(1, 2, 4, 4)  # (B, C, H, W)
    patches = patchify(images, 2)
    assert patches.shape == (1, 4, 2 * 2 * 2)
    # Patch 1 is the top-right square: rows 0-1, columns 2-3, channel 0 then channel 1.
    expected = torch.cat([images[0, 0, 0:2, 2:4].flatten(), images[0, 1, 0:2, 2:4].flatten()])
    assert torch.equal(patches[0, 1], expected)
    unfolded = nn.functional.unfold(images, kernel_size=2, stride=2).transpose(1, 2)  # (B, N, C p p)
    assert torch.equal(patches, unfolded)
    with pytest.raises(ValueError, match="must divide"):
        patchify(images, 3)


def test_conv_and_linear_patch_embeddings_agree():
    torch.manual_seed(0)
    conv = PatchEmbedding(8, 4, 3, 16, method="conv", dtype=torch.float64)
    linear = PatchEmbedding(8, 4, 3, 16, method="linear", dtype=torch.float64)
    with torch.no_grad():
        linear.proj.weight.copy_(conv.proj.weight.reshape(16, 3 * 4 * 4))  # (E, C p p)
        linear.proj.bias.copy_(conv.proj.bias)
    images = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    torch.testing.assert_close(linear(images), conv(images), atol=1e-12, rtol=1e-12)
    assert conv(images).shape == (2, 4, 16)
    with pytest.raises(ValueError, match=r"\(B, 3, 8, 8\)"):
        conv(torch.randn(2, 1, 8, 8, dtype=torch.float64))


def test_overlapping_patches_embed_a_wider_window_on_the_same_grid():
    torch.manual_seed(0)
    embed = PatchEmbedding(8, 2, 3, 16, overlap=1, dtype=torch.float64)  # 4 x 4 windows every 2 pixels
    images = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    tokens = embed(images)
    assert tokens.shape == (2, 16, 16), "one token per 2 x 2 cell, as without overlap"
    # Token n = r * 4 + c reads rows 2r-1 .. 2r+2 and columns 2c-1 .. 2c+2 of the zero-padded image.
    padded = nn.functional.pad(images, (1, 1, 1, 1))  # (B, C, 10, 10)
    weight, bias = embed.proj.weight, embed.proj.bias  # (E, C, 4, 4), (E,)
    for n in (0, 5, 15):
        r, c = divmod(n, 4)
        window = padded[:, :, 2 * r : 2 * r + 4, 2 * c : 2 * c + 4]  # (B, C, 4, 4)
        expected = window.flatten(1) @ weight.flatten(1).T + bias  # (B, E)
        torch.testing.assert_close(tokens[:, n], expected, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="method='conv'"):
        PatchEmbedding(8, 2, 1, 16, method="linear", overlap=1)
    with pytest.raises(ValueError, match="patch_embedding='conv'"):
        ViTConfig(patch_size=2, patch_embedding="linear", patch_overlap=1)
    with pytest.raises(ValueError, match="patch_overlap"):
        ViTConfig(patch_overlap=-1)


# ---------------------------------------------------------------- 2-D sine-cosine positions


def test_sincos_positions_2d_against_the_mae_formula_written_out():
    """MAE's get_2d_sincos_pos_embed (column half first, frequencies 10000^(-k / (dim/4))), with
    each half's sines and cosines interleaved as in the course's 1-D table."""
    Hg, Wg, dim = 3, 5, 16  # a non-square grid: rows and columns cannot be confused
    table = sincos_positions_2d(Hg, Wg, dim, dtype=torch.float64)
    assert table.shape == (Hg * Wg, dim) and table.dtype == torch.float64
    omega = 1.0 / 10000.0 ** (torch.arange(dim // 4, dtype=torch.float64) / (dim // 4))  # (dim/4,)
    for n in range(Hg * Wg):
        r, c = divmod(n, Wg)  # patches row by row, as patchify numbers them
        columns, rows = table[n, : dim // 2], table[n, dim // 2 :]
        torch.testing.assert_close(columns[0::2], torch.sin(c * omega), rtol=0, atol=1e-15)
        torch.testing.assert_close(columns[1::2], torch.cos(c * omega), rtol=0, atol=1e-15)
        torch.testing.assert_close(rows[0::2], torch.sin(r * omega), rtol=0, atol=1e-15)
        torch.testing.assert_close(rows[1::2], torch.cos(r * omega), rtol=0, atol=1e-15)
    assert sincos_positions_2d(4, 4, 64).dtype == torch.get_default_dtype()


def test_sincos_positions_2d_similarity_depends_only_on_the_offset():
    """<PE(r, c), PE(r', c')> = sum_k cos((r - r') w_k) + cos((c - c') w_k): a function of the offset."""
    side, dim = 6, 32
    table = sincos_positions_2d(side, side, dim, dtype=torch.float64).reshape(side, side, dim)
    offset = (1, 2)
    dots = [float(table[r, c] @ table[r + offset[0], c + offset[1]])
            for r in range(side - offset[0]) for c in range(side - offset[1])]
    assert max(dots) - min(dots) < 1e-12
    assert float(table[0, 0] @ table[0, 0]) == pytest.approx(dim / 2)  # every sin^2 + cos^2 pair is 1
    with pytest.raises(ValueError, match="divisible by 4"):
        sincos_positions_2d(4, 4, 30)
    with pytest.raises(ValueError, match="grid_width"):
        sincos_positions_2d(4, 0, 32)


def test_sincos2d_model_uses_the_fixed_table_with_a_zero_row_for_the_class_token():
    config = dataclasses.replace(SMALL, position_embedding="sincos2d")
    model = small_model(config)
    assert not any("positions" in name for name, _ in model.named_parameters()), "nothing to learn"
    assert not any("positions" in key for key in model.state_dict()), "the table is rebuilt, not saved"
    tokens = torch.zeros(2, config.num_patches + 1, config.d_model, dtype=torch.float64)  # (B, N+1, E)
    added = model.positions(tokens)[0]  # (N+1, E)
    assert torch.equal(added[0], torch.zeros(config.d_model, dtype=torch.float64))
    torch.testing.assert_close(added[1:], sincos_positions_2d(2, 2, config.d_model, dtype=torch.float64))
    assert isinstance(small_model().positions, LearnedPositionalEmbedding)
    with pytest.raises(ValueError, match="divisible by 4"):
        ViTConfig(d_model=18, num_heads=2, position_embedding="sincos2d")
    with pytest.raises(ValueError, match="position_embedding"):
        ViTConfig(position_embedding="rotary")


# ---------------------------------------------------------------- the model


def test_shapes_maps_and_rows(device):
    model = small_model(device=device)
    images = images_for(SMALL).to(device)
    logits, maps = model(images, need_weights=True)
    assert logits.shape == (2, 3)
    N = SMALL.num_patches + 1
    assert len(maps) == SMALL.depth
    for weights in maps:
        assert weights.shape == (2, SMALL.num_heads, N, N)
        torch.testing.assert_close(weights.sum(-1), torch.ones(2, SMALL.num_heads, N, dtype=torch.float64, device=device))
    torch.testing.assert_close(model(images), logits)  # the fused path gives the same logits
    assert model.encode(images).shape == (2, N, SMALL.d_model)


def test_every_parameter_gets_a_gradient_and_nothing_is_nan():
    model = small_model().train()
    logits = model(images_for(SMALL))
    assert torch.isfinite(logits).all()
    nn.functional.cross_entropy(logits, torch.tensor([0, 2])).backward()
    for name, param in model.named_parameters():
        assert param.grad is not None, name
        assert torch.isfinite(param.grad).all(), name
        assert param.grad.abs().sum() > 0, name


def test_state_dict_keys():
    keys = set(small_model().state_dict())
    assert {"class_token", "positions.weight", "patch_embedding.proj.weight", "head.weight", "norm.weight"} <= keys
    assert "blocks.1.attention.q_proj.weight" in keys and "blocks.2.norm1.weight" not in keys


def test_block_is_pre_norm_with_residuals():
    torch.manual_seed(0)
    block = ViTBlock(8, 2, 16, dtype=torch.float64).eval()
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    after_attention = x + block.attention(block.norm1(x))
    expected = after_attention + block.mlp(block.norm2(after_attention))
    torch.testing.assert_close(block(x), expected, atol=1e-12, rtol=1e-12)


def _parameter_shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


@pytest.mark.parametrize("field", [f.name for f in dataclasses.fields(ViTConfig)])
def test_every_config_field_changes_the_model(field):
    changed_values = {
        "image_size": 12,
        "patch_size": 2,
        "in_channels": 3,
        "num_classes": 5,
        "d_model": 24,
        "depth": 3,
        "num_heads": 4,
        "mlp_ratio": 3.0,
        "dropout": 0.5,
        "attention_dropout": 0.5,
        "patch_embedding": "linear",
        "patch_overlap": 1,
        "position_embedding": "sincos2d",
        "layer_norm_eps": 1e-3,
    }
    assert set(changed_values) == {f.name for f in dataclasses.fields(ViTConfig)}, "a new field needs a case here"
    base = SMALL
    changed = dataclasses.replace(base, **{field: changed_values[field]})
    a, b = small_model(base), small_model(changed)
    if field in ("dropout", "attention_dropout"):
        # Same parameters; in training mode the outputs become random, in eval mode identical.
        assert _parameter_shapes(a) == _parameter_shapes(b)
        images = images_for(base)
        b.load_state_dict(a.state_dict())
        torch.testing.assert_close(b.eval()(images), a.eval()(images))
        b.train()
        torch.manual_seed(0)
        first = b(images)
        torch.manual_seed(1)
        assert not torch.allclose(first, b(images)), f"{field} has no effect in training mode"
        if field == "attention_dropout":
            assert all(block.attention.dropout == 0.5 for block in b.blocks)
        else:
            assert all(block.attention.dropout == 0.0 for block in b.blocks)
        return
    if field == "layer_norm_eps":
        # Same parameters; every LayerNorm (two per block and the final one) takes the new eps.
        norms = [m for m in b.modules() if isinstance(m, nn.LayerNorm)]
        assert len(norms) == 2 * base.depth + 1 and all(m.eps == 1e-3 for m in norms)
        b.load_state_dict(a.state_dict())
        images = images_for(base)
        assert not torch.allclose(a(images), b(images), atol=1e-9, rtol=0)
        return
    if field == "num_heads":
        # Same parameter shapes, different split: the attention maps gain heads.
        images = images_for(base)
        assert model_maps(b, images)[0].shape[1] == 4 and model_maps(a, images)[0].shape[1] == 2
        b.load_state_dict(a.state_dict())
        assert not torch.allclose(a(images), b(images))
        return
    assert _parameter_shapes(a) != _parameter_shapes(b), f"{field} did not change the model"
    logits = b(images_for(changed))
    assert logits.shape == (2, changed.num_classes)


def model_maps(model: VisionTransformer, images: torch.Tensor) -> list[torch.Tensor]:
    return model(images, need_weights=True)[1]


def _timm_style_logits(model: VisionTransformer, images: torch.Tensor, *, eps: float) -> torch.Tensor:
    """The ViT forward pass written out as timm's VisionTransformer computes it, LayerNorm eps explicit."""
    E, H = model.config.d_model, model.config.num_heads

    def norm(x: torch.Tensor, module: nn.LayerNorm) -> torch.Tensor:
        return nn.functional.layer_norm(x, (E,), module.weight, module.bias, eps=eps)

    x = model.patch_embedding.proj(images).flatten(2).transpose(1, 2)  # (B, N, E)
    x = torch.cat((model.class_token.expand(x.shape[0], -1, -1), x), dim=1) + model.positions.weight  # (B, N+1, E)
    for block in model.blocks:
        attention, y = block.attention, norm(x, block.norm1)
        B, N, _ = y.shape
        q, k, v = (p(y).view(B, N, H, E // H).transpose(1, 2) for p in (attention.q_proj, attention.k_proj, attention.v_proj))
        x = x + attention.out_proj(nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, N, E))
        x = x + block.mlp(norm(x, block.norm2))
    return model.head(norm(x, model.norm)[:, 0])  # (B, classes)


def test_layer_norm_eps_defaults_to_the_reference_vits():
    """timm and the original ViT use LayerNorm eps 1e-6; with PyTorch's 1e-5 ported weights drift by ~5e-5."""
    assert ViTConfig().layer_norm_eps == 1e-6 == ViTConfig.digits().layer_norm_eps
    model = small_model()
    images = images_for(SMALL) * 0.01  # small activations: the eps is a visible part of the variance
    got = model(images)
    # Measured |ours - timm-style| = 0.0 (float64, the same operations); with eps 1e-5 in the reference 2.7e-4.
    torch.testing.assert_close(got, _timm_style_logits(model, images, eps=1e-6), atol=1e-12, rtol=1e-12)
    assert (got - _timm_style_logits(model, images, eps=1e-5)).abs().max() > 1e-8  # the check can fail
    with pytest.raises(ValueError, match=r"layer_norm_eps must be > 0, got 0"):
        ViTConfig(layer_norm_eps=0.0)
    with pytest.raises(TypeError, match=r"layer_norm_eps must be a float, got str"):
        ViTConfig(layer_norm_eps="1e-6")


def test_config_validation_and_preset():
    with pytest.raises(ValueError, match="must divide image_size"):
        ViTConfig(image_size=8, patch_size=3)
    with pytest.raises(ValueError, match="must divide d_model"):
        ViTConfig(d_model=30, num_heads=4)
    with pytest.raises(ValueError, match="patch_embedding"):
        ViTConfig(patch_embedding="unfold")
    with pytest.raises(dataclasses.FrozenInstanceError):
        SMALL.depth = 3  # type: ignore[misc]
    preset = ViTConfig.digits()
    assert (preset.image_size, preset.in_channels, preset.num_classes) == (8, 1, 10)
    with pytest.raises(TypeError, match="ViTConfig"):
        VisionTransformer({"depth": 2})  # type: ignore[arg-type]


def test_a_few_steps_reduce_the_loss_on_a_tiny_batch():
    torch.manual_seed(0)
    model = VisionTransformer(SMALL)
    images = torch.randn(8, 1, 8, 8)
    labels = torch.arange(8) % 3
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(15):
        loss = nn.functional.cross_entropy(model(images), labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]


# ---------------------------------------------------------------- attention rollout


def test_rollout_of_one_layer_is_the_head_mean_mixed_with_identity():
    maps = [torch.softmax(torch.randn(2, 3, 5, 5, dtype=torch.float64), dim=-1)]
    expected = 0.5 * maps[0].mean(1) + 0.5 * torch.eye(5, dtype=torch.float64)
    torch.testing.assert_close(attention_rollout(maps), expected)
    torch.testing.assert_close(attention_rollout(maps, residual=False), maps[0].mean(1))


def test_rollout_chains_layers_first_layer_on_the_right():
    gen = torch.Generator().manual_seed(0)
    maps = [torch.softmax(torch.randn(1, 2, 4, 4, dtype=torch.float64, generator=gen), dim=-1) for _ in range(3)]
    mixed = [0.5 * m.mean(1) + 0.5 * torch.eye(4, dtype=torch.float64) for m in maps]
    torch.testing.assert_close(attention_rollout(maps), mixed[2] @ mixed[1] @ mixed[0])
    rollout = attention_rollout(model_maps(small_model(), images_for(SMALL)))
    N = SMALL.num_patches + 1
    assert rollout.shape == (2, N, N)
    torch.testing.assert_close(rollout.sum(-1), torch.ones(2, N, dtype=torch.float64))
    with pytest.raises(ValueError, match="at least one"):
        attention_rollout([])


# ---------------------------------------------------------------- the token-mixing probe


class ArticleViTAttention(nn.Module):
    """The source article's ViT attention, reproduced with its bug (do not use).

    ``qkv.reshape(B, N, 3, H, D)`` then ``unbind(2)`` leaves q, k, v as ``(B, N, H, D)``;
    ``q @ k.transpose(-2, -1)`` is then ``(B, N, H, H)``: every token attends across its
    own heads, never to other tokens. The final transpose/reshape scrambles the rest.
    """

    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.scale = (dim // num_heads) ** -0.5
        self.qkv = nn.Linear(dim, dim * 3)
        self.proj = nn.Linear(dim, dim)
        self.last_weights: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, C // self.num_heads)  # (B, N, 3, H, D)
        q, k, v = qkv.unbind(2)  # (B, N, H, D) each -- heads NOT moved in front of tokens
        attn = (q @ k.transpose(-2, -1)) * self.scale  # (B, N, H, H): heads attend to heads
        attn = attn.softmax(dim=-1)
        self.last_weights = attn
        x = (attn @ v).transpose(1, 2).reshape(B, N, C)  # (B, N, H, D) -> (B, H, N, D) -> scrambled
        return self.proj(x)


def every_token_reaches_every_other(influence: torch.Tensor) -> bool:
    off_diagonal = ~torch.eye(influence.shape[0], dtype=torch.bool)
    return bool((influence[off_diagonal] > 1e-9).all())


def test_probe_passes_for_the_package_attention_and_the_vit():
    torch.manual_seed(0)
    tokens = torch.randn(2, 9, 16, dtype=torch.float64)
    attention = MultiHeadAttention(16, 4, dtype=torch.float64)
    assert every_token_reaches_every_other(token_influence(attention, tokens))
    model = small_model()
    patches = model.patch_embedding(images_for(SMALL))  # (B, N, E)
    # Through a whole block: perturbing patch j moves the output at every token i != j.
    assert every_token_reaches_every_other(token_influence(model.blocks[0], patches))
    # And on the images: changing one patch's pixels moves every token of the encoder output.
    images = images_for(SMALL)
    base = model.encode(images)
    for j, (r, c) in enumerate([(0, 0), (0, 1), (1, 0), (1, 1)]):
        moved = images.clone()
        moved[:, :, 4 * r : 4 * r + 4, 4 * c : 4 * c + 4] += 1.0
        change = (model.encode(moved) - base).abs().amax(dim=(0, 2))  # (N+1,)
        assert (change > 1e-9).all(), f"perturbing patch {j} left some tokens unchanged"


def test_probe_fails_for_the_article_attention():
    torch.manual_seed(0)
    tokens = torch.randn(2, 9, 16, dtype=torch.float64)
    buggy = ArticleViTAttention(16, 4).double()
    influence = token_influence(buggy, tokens)
    assert not every_token_reaches_every_other(influence)
    # Its "attention map" is (B, N, H, H), not (B, H, N, N): it never compares two tokens.
    assert buggy.last_weights.shape == (2, 9, 4, 4)
    # Each output token depends on only H of the N input tokens (a side effect of the reshape).
    assert int((influence > 1e-9).sum(dim=1).max()) <= 4 < 9


def test_runs_under_bfloat16_autocast():
    torch.manual_seed(0)  # the error depends on the weights: fix them
    model = VisionTransformer(SMALL).eval()
    images = images_for(SMALL, dtype=torch.float32)
    expected = model(images)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits, maps = model(images, need_weights=True)
    assert torch.isfinite(logits).all() and all(torch.isfinite(m).all() for m in maps)
    # bf16 matmuls through 2 blocks: within two bf16 rounding steps at the largest logit (2 eps * max).
    # Measured |error| / (eps * max): 0.20 with these weights (AVX-512 and AVX2 kernels alike), at most
    # 1.07 over 20 random initialisations. Was atol = rtol = 0.1: as large as the logits (~0.13).
    tol = 2 * torch.finfo(torch.bfloat16).eps * expected.abs().max().item()
    torch.testing.assert_close(logits.float(), expected, atol=tol, rtol=0)
