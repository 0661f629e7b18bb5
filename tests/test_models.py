"""TinyAttentionModel: shapes, gradients, config reaching the modules, causality; token_influence."""

from __future__ import annotations

import pytest
import torch

import attn_course as ac
from attn_course.diagnostics import token_influence
from attn_course.models import TinyAttentionConfig, TinyAttentionModel


def _model(seed=0, **overrides):
    torch.manual_seed(seed)
    config = TinyAttentionConfig(**{"vocab_size": 7, "num_classes": 5, "max_len": 12, **overrides})
    return TinyAttentionModel(config)


def _tokens(B=3, L=9, vocab=7, seed=0):
    return torch.randint(0, vocab, (B, L), generator=torch.Generator().manual_seed(seed))


def test_output_shape_gradients_and_finite():
    model = _model(num_layers=2, mlp_ratio=2)
    logits = model(_tokens())
    assert logits.shape == (3, 9, 5) and torch.isfinite(logits).all()
    logits.square().mean().backward()
    # every parameter tensor gets a gradient (position rows past L = 9 stay zero, which is fine)
    missing = [name for name, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert missing == []


def test_config_fields_reach_the_modules():
    model = _model(d_model=24, num_heads=3, num_layers=4, mlp_ratio=3, causal=False)
    assert model.token_embedding.weight.shape == (7, 24)
    assert model.position_embedding.weight.shape == (12, 24)
    assert model.readout.out_features == 5
    assert len(model.blocks) == 4
    for block in model.blocks:
        assert block.attn.num_heads == 3 and block.attn.d_model == 24
        assert block.mlp is not None and block.mlp[1].out_features == 72
        assert block.causal is False
    assert all(block.mlp is None for block in _model(mlp_ratio=0).blocks)
    keys = set(_model().state_dict())
    assert {"token_embedding.weight", "position_embedding.weight", "blocks.0.attn.q_proj.weight", "readout.bias"} <= keys


def _block_by_hand(block, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One pre-norm causal block written out with plain tensor operations: (new x, weights (B, H, L, L))."""
    attn, (B, L, E) = block.attn, x.shape
    H, D = attn.num_heads, attn.head_dim
    h = block.attn_norm(x)
    q, k, v = (proj(h).view(B, L, H, D).transpose(1, 2) for proj in (attn.q_proj, attn.k_proj, attn.v_proj))
    scores = (q @ k.transpose(-2, -1)) / D**0.5  # (B, H, L, L)
    scores = scores.masked_fill(torch.ones(L, L, dtype=torch.bool).triu(1), float("-inf"))  # no future keys
    weights = torch.softmax(scores, dim=-1)
    x = x + attn.out_proj((weights @ v).transpose(1, 2).reshape(B, L, E))
    return (x if block.mlp is None else x + block.mlp(x)), weights


def test_attention_maps_are_the_layers_weights():
    model = _model(num_layers=2, num_heads=2)
    tokens = _tokens()
    maps = model.attention_maps(tokens)
    assert [m.shape for m in maps] == [(3, 2, 9, 9)] * 2
    # Every layer's weights, recomputed by hand (not through MultiHeadAttention), layer 1 from layer 0's output.
    with torch.no_grad():
        x = model.token_embedding(tokens) + model.position_embedding.weight[:9]
        for block, got in zip(model.blocks, maps):
            x, expected = _block_by_hand(block, x)
            torch.testing.assert_close(got, expected, atol=3e-7, rtol=0)  # float32 weights <= 1; measured 6.0e-8
    for m in maps:
        torch.testing.assert_close(m.sum(-1), torch.ones(3, 2, 9))
        assert (m.triu(1) == 0).all(), "causal model: no weight on the future"
    assert model.training, "attention_maps restores training mode"


def test_causal_model_never_reads_the_future_and_bidirectional_does():
    tokens = _tokens(B=4, L=8)
    causal = token_influence(_model(num_layers=2), tokens, vocab_size=7) > 0
    assert torch.equal(causal, ac.causal_mask(8)), "output t depends on exactly tokens 0..t"
    full = token_influence(_model(num_layers=2, causal=False), tokens, vocab_size=7) > 0
    assert full.all()


def test_model_rejects_bad_tokens():
    model = _model()
    with pytest.raises(TypeError, match="torch.long"):
        model(torch.zeros(2, 3))
    with pytest.raises(ValueError, match=r"\(B, L\)"):
        model(torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="exceeds max_len=12"):
        model(torch.zeros(1, 13, dtype=torch.long))
    with pytest.raises(ValueError, match=r"\[0, 7\)"):
        model(torch.full((1, 3), 7))
    with pytest.raises(ValueError, match="num_heads must be >= 1, got 0"):
        TinyAttentionConfig(vocab_size=3, num_classes=3, max_len=4, num_heads=0)
    with pytest.raises(ValueError, match="not divisible"):
        _model(d_model=10, num_heads=3)


def test_token_influence_on_float_inputs():
    x = torch.randn(2, 5, 4, dtype=torch.float64)
    doubled = token_influence(lambda t: t * 2, x, scale=0.5)
    assert torch.equal(doubled > 0, torch.eye(5, dtype=torch.bool))
    direction = torch.randn(4, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 0.5
    torch.testing.assert_close(doubled.diagonal(), (2 * direction).abs().max().expand(5), rtol=1e-12, atol=1e-12)
    assert torch.equal(token_influence(lambda t: t.cumsum(1), x) > 1e-9, ac.causal_mask(5))
    assert torch.equal(token_influence(lambda t: t.flip(1), x) > 0, torch.eye(5, dtype=torch.bool).flip(1))
    # a sequence-level output (B, 1, E) reads every position
    assert token_influence(lambda t: t.sum(1, keepdim=True), x).shape == (1, 5)


def test_token_influence_catches_merging_heads_without_the_transpose():
    torch.manual_seed(0)
    mha = ac.MultiHeadAttention(8, 2, dtype=torch.float64)
    x = torch.randn(2, 6, 8, dtype=torch.float64)

    def per_token_mix(t):  # attends across the head axis of each token: no token mixing at all
        B, L, E = t.shape
        q = mha.q_proj(t).view(B, L, 2, 4)  # (B, L, H, D): heads never moved in front of L
        k = mha.k_proj(t).view(B, L, 2, 4)  # (B, L, H, D)
        v = mha.v_proj(t).view(B, L, 2, 4)  # (B, L, H, D)
        return ac.scaled_dot_product_attention(q, k, v).reshape(B, L, E)  # (B, L, E)

    assert (token_influence(mha, x) > 1e-6).all()
    assert torch.equal(token_influence(per_token_mix, x) > 1e-12, torch.eye(6, dtype=torch.bool))


def test_token_influence_rejects_bad_input():
    with pytest.raises(ValueError, match="pass vocab_size"):
        token_influence(lambda t: t, torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match=r"\(B, L, \.\.\.\)"):
        token_influence(lambda t: t, torch.zeros(3))
    with pytest.raises(ValueError, match="must return a tensor"):
        token_influence(lambda t: t.sum(), torch.zeros(2, 3))
