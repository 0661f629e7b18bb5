"""Small models for the lesson demos.

* ``TinyAttentionModel``: token + position embeddings, a few pre-norm blocks of
  ``attn_course.MultiHeadAttention`` (optionally with an MLP), and a linear read-out at every
  position. Small enough to train in seconds on a laptop CPU; ``attention_maps`` returns every
  layer's per-head weights for the head explorer. Trained in lesson 02 (multi-head attention).
* The probe that shows which positions a trained model mixes, ``token_influence``, is a
  diagnostic: it lives in ``attn_course.diagnostics`` (model modules import no measuring code).

Shape legend: B batch, H heads, L length, E model dim (``d_model``), C classes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from ._checks import check_int, check_positive_int, shape_str
from .multihead import MultiHeadAttention

__all__ = ["TinyAttentionConfig", "TinyAttentionModel"]


@dataclass(frozen=True)
class TinyAttentionConfig:
    """Sizes of a ``TinyAttentionModel``.

    Attributes:
        vocab_size: number of input token ids.
        num_classes: number of outputs per position (C).
        max_len: longest sequence the learned position table covers.
        d_model: model dim E.
        num_heads: heads per attention layer H (must divide ``d_model``).
        num_layers: number of attention blocks.
        mlp_ratio: hidden size of the per-position MLP after each attention, as a multiple
            of ``d_model``; 0 means attention-only blocks.
        causal: position ``t`` attends only to positions ``<= t``.
    """

    vocab_size: int
    num_classes: int
    max_len: int
    d_model: int = 32
    num_heads: int = 2
    num_layers: int = 1
    mlp_ratio: int = 0
    causal: bool = True

    def __post_init__(self) -> None:
        for name in ("vocab_size", "num_classes", "max_len", "d_model", "num_heads", "num_layers"):
            check_positive_int(name, getattr(self, name))
        check_int("mlp_ratio", self.mlp_ratio, minimum=0)


class _Block(nn.Module):
    """Pre-norm residual block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))`` if any."""

    def __init__(self, config: TinyAttentionConfig) -> None:
        super().__init__()
        E = config.d_model
        self.causal = config.causal
        self.attn_norm = nn.LayerNorm(E)
        self.attn = MultiHeadAttention(E, config.num_heads)
        self.mlp: nn.Module | None = None
        if config.mlp_ratio:
            self.mlp = nn.Sequential(
                nn.LayerNorm(E),
                nn.Linear(E, config.mlp_ratio * E),
                nn.GELU(),
                nn.Linear(config.mlp_ratio * E, E),
            )

    def forward(self, x: torch.Tensor, *, need_weights: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        attended = self.attn(self.attn_norm(x), is_causal=self.causal, need_weights=need_weights)
        out, weights = attended if need_weights else (attended, None)  # (B, L, E), (B, H, L, L)
        x = x + out  # (B, L, E)
        if self.mlp is not None:
            x = x + self.mlp(x)  # (B, L, E)
        return x, weights


class TinyAttentionModel(nn.Module):
    """A few attention blocks over token + learned position embeddings, a class per position.

    ``forward(tokens)`` maps ``(B, L)`` token ids to logits ``(B, L, C)``;
    ``attention_maps(tokens)`` returns each layer's weights ``(B, H, L, L)``.
    """

    def __init__(self, config: TinyAttentionConfig) -> None:
        super().__init__()
        if not isinstance(config, TinyAttentionConfig):
            raise TypeError(f"config must be a TinyAttentionConfig, got {type(config).__name__}")
        self.config = config
        self.token_embedding = nn.Embedding(config.vocab_size, config.d_model)
        self.position_embedding = nn.Embedding(config.max_len, config.d_model)
        self.blocks = nn.ModuleList(_Block(config) for _ in range(config.num_layers))
        self.final_norm = nn.LayerNorm(config.d_model)
        self.readout = nn.Linear(config.d_model, config.num_classes)

    def _check_tokens(self, tokens: object) -> torch.Tensor:
        if not isinstance(tokens, torch.Tensor) or tokens.dtype != torch.long:
            got = tokens.dtype if isinstance(tokens, torch.Tensor) else type(tokens).__name__
            raise TypeError(f"tokens must be a torch.long tensor (B, L) of token ids, got {got}")
        if tokens.dim() != 2:
            raise ValueError(f"tokens must be (B, L), got shape {shape_str(tokens.shape)}")
        if tokens.shape[1] > self.config.max_len:
            raise ValueError(f"sequence length {tokens.shape[1]} exceeds max_len={self.config.max_len}")
        if tokens.numel() and (tokens.min() < 0 or tokens.max() >= self.config.vocab_size):
            raise ValueError(
                f"token ids must lie in [0, {self.config.vocab_size}), got min {int(tokens.min())}, "
                f"max {int(tokens.max())}"
            )
        return tokens

    def _run(self, tokens: torch.Tensor, *, need_weights: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
        tokens = self._check_tokens(tokens)
        L = tokens.shape[1]
        x = self.token_embedding(tokens) + self.position_embedding.weight[:L]  # (B, L, E)
        maps = []
        for block in self.blocks:
            x, weights = block(x, need_weights=need_weights)  # (B, L, E), (B, H, L, L) or None
            if weights is not None:
                maps.append(weights)
        return self.readout(self.final_norm(x)), maps  # (B, L, C)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits ``(B, L, C)`` for token ids ``(B, L)``."""
        return self._run(tokens, need_weights=False)[0]

    @torch.no_grad()
    def attention_maps(self, tokens: torch.Tensor) -> list[torch.Tensor]:
        """Every layer's attention weights, a list of ``(B, H, L, L)`` tensors (evaluation mode)."""
        was_training = self.training
        self.eval()
        try:
            return self._run(tokens, need_weights=True)[1]
        finally:
            self.train(was_training)
