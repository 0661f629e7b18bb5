"""Vision Transformer (Dosovitskiy et al., 2021), small enough to train on a laptop CPU.

    images (B, C, H, W)
      -> patches: cut into N = (H/p)(W/p) squares of p x p pixels, each flattened  (B, N, C p p)
      -> patch embedding: one linear map per patch (a strided conv does the same)   (B, N, E)
      -> prepend a learned class token, add learned positions                       (B, N+1, E)
      -> depth x pre-norm block:  x = x + MHA(LayerNorm(x));  x = x + MLP(LayerNorm(x))
      -> LayerNorm, read the class token, linear head                               (B, classes)

The attention is the package's ``MultiHeadAttention``; ask for the per-layer, per-head
attention maps with ``model(images, need_weights=True)`` and combine them across layers
with :func:`attention_rollout` (Abnar & Zuidema, 2020).

:func:`attn_course.diagnostics.token_influence` measures which output tokens change when one input token is
perturbed: in real self-attention every token reaches every other one. The source article's
ViT attention (``qkv.reshape(B, N, 3, H, D)`` multiplied without moving the heads in front)
attends across *heads* inside each token instead; the probe exposes it (see the tests and
lesson 09).

Shape legend: B batch, H heads, N tokens (patches, + 1 with the class token), E model dim.

Taught in lesson 09 (Vision Transformer).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn as nn

from ._checks import check_int, check_positive_int, check_tensor, shape_str
from .multihead import MultiHeadAttention
from .positional import LearnedPositionalEmbedding

__all__ = [
    "ViTConfig",
    "DIGITS_TRAINING",
    "patchify",
    "sincos_positions_2d",
    "PatchEmbedding",
    "ViTBlock",
    "VisionTransformer",
    "attention_rollout",
]


@dataclass(frozen=True)
class ViTConfig:
    """Every size and switch of a :class:`VisionTransformer`.

    Attributes:
        image_size: height = width of the (square) input images, in pixels.
        patch_size: side p of the square patches; must divide ``image_size``.
        in_channels: colour channels C of the images (1 for greyscale).
        num_classes: size of the classification head's output.
        d_model: model dim E of every token.
        depth: number of transformer blocks.
        num_heads: attention heads H per block; must divide ``d_model``.
        mlp_ratio: hidden width of each block's MLP, as a multiple of ``d_model``.
        dropout: dropout after the embeddings and inside/after the MLP and attention output.
        attention_dropout: dropout on the attention weights.
        patch_embedding: ``"conv"`` (a ``p x p`` conv with stride ``p``) or ``"linear"``
            (:func:`patchify` then ``nn.Linear``); the same function, two spellings.
        patch_overlap: how many pixels each token's window reaches beyond its ``p x p`` cell on
            every side (``"conv"`` embedding only). 0 is the ViT paper's non-overlapping patches;
            with ``v > 0`` each token embeds a ``(p + 2v) x (p + 2v)`` window (a conv with
            kernel ``p + 2v``, stride ``p``, zero padding ``v``) and the grid of tokens is
            unchanged: neighbouring tokens share pixels (an overlapping patch embedding in the
            spirit of PVTv2's, which uses kernel ``K = 2S - 1`` for stride ``S`` with padding
            ``K // 2``: kernel 7 with stride 4 (padding 3), kernel 3 with stride 2 (padding 1), then
            a LayerNorm; Xiao et al. (2021)
            show that early convolutions help ViTs on little data).
        position_embedding: ``"learned"`` (a trained ``(N+1, E)`` table, as in the ViT paper) or
            ``"sincos2d"`` (the fixed table of :func:`sincos_positions_2d`, zeros for the class
            token, as in MAE; nothing to learn).
        layer_norm_eps: the ``eps`` of every LayerNorm (the two in each block and the final
            one). 1e-6, as in the original ViT code and timm, so that weights ported from them
            give the same logits; PyTorch's own default, 1e-5, shifts them by about 5e-5.
    """

    image_size: int = 8
    patch_size: int = 4
    in_channels: int = 1
    num_classes: int = 10
    d_model: int = 64
    depth: int = 4
    num_heads: int = 4
    mlp_ratio: float = 2.0
    dropout: float = 0.0
    attention_dropout: float = 0.0
    patch_embedding: Literal["conv", "linear"] = "conv"
    patch_overlap: int = 0
    position_embedding: Literal["learned", "sincos2d"] = "learned"
    layer_norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        for name in ("image_size", "patch_size", "in_channels", "num_classes", "d_model", "depth", "num_heads"):
            check_positive_int(f"ViTConfig.{name}", getattr(self, name))
        if self.image_size % self.patch_size:
            raise ValueError(
                f"patch_size={self.patch_size} must divide image_size={self.image_size} (patches tile the image)"
            )
        if self.d_model % self.num_heads:
            raise ValueError(f"num_heads={self.num_heads} must divide d_model={self.d_model}")
        if self.mlp_ratio <= 0:
            raise ValueError(f"mlp_ratio must be > 0, got {self.mlp_ratio}")
        for name in ("dropout", "attention_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"ViTConfig.{name} must be in [0, 1), got {getattr(self, name)}")
        if self.patch_embedding not in ("conv", "linear"):
            raise ValueError(f"patch_embedding must be 'conv' or 'linear', got {self.patch_embedding!r}")
        check_int("ViTConfig.patch_overlap", self.patch_overlap, minimum=0)
        if self.patch_overlap and self.patch_embedding != "conv":
            raise ValueError("patch_overlap > 0 needs patch_embedding='conv' (patchify cuts non-overlapping squares)")
        if self.position_embedding not in ("learned", "sincos2d"):
            raise ValueError(f"position_embedding must be 'learned' or 'sincos2d', got {self.position_embedding!r}")
        if self.position_embedding == "sincos2d" and self.d_model % 4:
            raise ValueError(f"position_embedding='sincos2d' needs d_model divisible by 4, got {self.d_model}")
        if isinstance(self.layer_norm_eps, bool) or not isinstance(self.layer_norm_eps, (int, float)):
            raise TypeError(f"ViTConfig.layer_norm_eps must be a float, got {type(self.layer_norm_eps).__name__}")
        if not self.layer_norm_eps > 0:
            raise ValueError(f"ViTConfig.layer_norm_eps must be > 0, got {self.layer_norm_eps}")

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def mlp_dim(self) -> int:
        return int(round(self.d_model * self.mlp_ratio))

    @classmethod
    def digits(cls) -> ViTConfig:
        """The lesson-09 model for scikit-learn's 8x8 digits (see ``attn_course.data.images``).

        16 tokens of 2x2 cells, each embedding the 4x4 window around its cell (``patch_overlap=1``),
        + the class token; E = 32, 4 blocks of 4 heads, MLP 2E, no dropout: about 36 k parameters.
        Trained with ``attn_course.training.fit(..., augment=random_shift, **DIGITS_TRAINING)``.

        Chosen on the **validation** split of ``load_digits_split()`` (1077 training, 270
        validation images; the test split was not used), within a budget of about 30 s of one
        CPU core, every run with one-pixel random shifts, AdamW and a cosine schedule. Validation
        accuracy, plain argmax (seeds in brackets):

        * non-overlapping 2x2 patches (the ViT paper's cut): E = 64 with batches of 128, 120-150
          epochs: 97.0-97.4% [0]; E = 32 with batches of 64, 120 epochs: 96.7-97.4% [0, 1, 2];
          98.1% [0] with E = 48 or depth 3 and 150-200 epochs, over the budget (44-59 s);
        * 2-D sine-cosine positions instead of learned ones: 98.5% (non-overlapping, E = 64, 150
          epochs) and 97.8% (overlapping, E = 32) [0]: no consistent gain, so learned positions;
        * overlapping 4x4 windows, E = 32, batches of 64, 120 epochs: 98.1-98.9% [0, 1, 2];
          E = 48 or 64 with batches of 128 (fewer steps in the same time): 97.4-97.8% [0];
        * averaging the predictions over the 9 one-pixel shifts lifted the overlapping model to
          98.9-99.3% [0, 1, 2], and with it 80 epochs did as well as 120 (99.3% [0, 1]), so the
          preset trains for 80 (1360 steps, 24-27 s of one core on a loaded 2-core machine).

        Those runs used PyTorch's LayerNorm eps (1e-5). The preset as defined, with the reference
        eps 1e-6 (the ``layer_norm_eps`` default), trained on one thread as lesson 09 does (measured
        again on a 2-core machine): 95.9-98.5% plain, 98.9-99.3% averaged over the shifts [0, 1, 2],
        on validation: averaging ahead on every seed, by 1, 4 and 9 of the 270 images. Plain
        predictions vary more between seeds (and CPUs) than averaged ones.

        With 4x4 patches the digits are only 4 tokens: too few for attention to show anything.
        """
        return cls(
            image_size=8,
            patch_size=2,
            patch_overlap=1,
            in_channels=1,
            num_classes=10,
            d_model=32,
            depth=4,
            num_heads=4,
            mlp_ratio=2.0,
            dropout=0.0,
        )


#: Keyword arguments for ``attn_course.training.fit`` that go with ``ViTConfig.digits()`` (pass
#: ``augment=attn_course.data.images.random_shift`` as well; chosen on validation, see ``digits``).
DIGITS_TRAINING: dict[str, float | int] = {
    "epochs": 80,
    "batch_size": 64,
    "lr": 3e-3,
    "weight_decay": 0.05,
    "warmup_steps": 50,
}


def patchify(images: torch.Tensor, patch_size: int) -> torch.Tensor:
    """Cut images ``(B, C, H, W)`` into flattened patches ``(B, N, C * p * p)``, row by row.

    Patch ``n = r * (W/p) + c`` covers rows ``r p .. r p + p - 1`` and columns
    ``c p .. c p + p - 1``; its features are ordered (channel, row, column), which is the
    order of a ``Conv2d`` weight ``(E, C, p, p)`` flattened -- so a strided conv and
    ``patchify`` + ``Linear`` compute the same embedding.
    """
    images = check_tensor("images", images, min_dim=4)
    if images.dim() != 4:
        raise ValueError(f"images must be (B, C, H, W), got shape {shape_str(images.shape)}")
    check_positive_int("patch_size", patch_size)
    B, C, H, W = images.shape
    p = patch_size
    if H % p or W % p:
        raise ValueError(f"patch_size={p} must divide the image height and width, got images {shape_str(images.shape)}")
    x = images.reshape(B, C, H // p, p, W // p, p)  # (B, C, H/p, p, W/p, p)
    x = x.permute(0, 2, 4, 1, 3, 5)  # (B, H/p, W/p, C, p, p)
    return x.reshape(B, (H // p) * (W // p), C * p * p)  # (B, N, C p p)


def sincos_positions_2d(
    grid_height: int,
    grid_width: int,
    dim: int,
    *,
    base: float = 10000.0,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Fixed 2-D sine-cosine positions for a ``grid_height x grid_width`` grid of patches: ``(N, dim)``.

    Patch ``n = r * grid_width + c`` (row by row, as :func:`patchify` numbers them) gets its
    column's 1-D sinusoidal table in the first half of the features and its row's in the
    second: ``concat(sinusoidal_encoding(c, dim/2), sinusoidal_encoding(r, dim/2))``, each half
    laid out as in :func:`attn_course.positional.sinusoidal_encoding` (sine and cosine
    interleaved, frequencies ``base^(-k / (dim/4))``, k = 0 .. dim/4 - 1). This is the table of
    MAE (He et al., 2022) and of Beyer et al. (2022), up to the order of features. Computed in
    float64, returned in ``dtype`` (default: the default float dtype).
    """
    for name, value in (("grid_height", grid_height), ("grid_width", grid_width), ("dim", dim)):
        check_positive_int(name, value)
    if dim % 4:
        raise ValueError(f"dim must be divisible by 4 (a sine and a cosine for rows and for columns), got {dim}")
    quarter = dim // 4
    rows, cols = torch.meshgrid(
        torch.arange(grid_height, dtype=torch.float64), torch.arange(grid_width, dtype=torch.float64), indexing="ij"
    )  # (Hg, Wg) each
    frequencies = base ** -(torch.arange(quarter, dtype=torch.float64) / quarter)  # (dim/4,), 1 down to ~1/base

    def half(coordinate: torch.Tensor) -> torch.Tensor:
        angles = coordinate.reshape(-1, 1) * frequencies  # (N, dim/4)
        return torch.stack((angles.sin(), angles.cos()), dim=-1).flatten(1)  # (N, dim/2), interleaved

    table = torch.cat((half(cols), half(rows)), dim=-1)  # (N, dim): columns first, then rows
    return table.to(device=device, dtype=dtype or torch.get_default_dtype())


class _FixedPositions(nn.Module):
    """Adds a fixed table ``(N, E)`` (a buffer, not a parameter) to ``x`` ``(B, N, E)``."""

    def __init__(self, table: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("table", table, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.table  # (B, N, E)


class PatchEmbedding(nn.Module):
    """Images ``(B, C, H, W)`` -> one E-dim token per patch ``(B, N, E)``.

    ``method="conv"``: ``Conv2d(C, E, kernel_size=p, stride=p)``, then flatten the grid.
    ``method="linear"``: :func:`patchify`, then ``Linear(C p p, E)``. Same maths; the conv
    is the usual spelling, the linear one shows what it does.
    ``overlap=v`` (conv only): kernel ``p + 2v``, stride ``p``, zero padding ``v``: each token
    embeds its cell and ``v`` pixels around it; still one token per ``p x p`` cell.
    """

    def __init__(
        self,
        image_size: int,
        patch_size: int,
        in_channels: int,
        d_model: int,
        *,
        method: Literal["conv", "linear"] = "conv",
        overlap: int = 0,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if method not in ("conv", "linear"):
            raise ValueError(f"method must be 'conv' or 'linear', got {method!r}")
        check_int("overlap", overlap, minimum=0)
        if overlap and method != "conv":
            raise ValueError("overlap > 0 needs method='conv' (patchify cuts non-overlapping squares)")
        factory = {"device": device, "dtype": dtype}
        self.image_size = image_size
        self.patch_size = patch_size
        self.in_channels = in_channels
        self.method = method
        self.overlap = overlap
        self.num_patches = (image_size // patch_size) ** 2
        if method == "conv":
            self.proj: nn.Module = nn.Conv2d(
                in_channels, d_model, kernel_size=patch_size + 2 * overlap, stride=patch_size, padding=overlap, **factory
            )
        else:
            self.proj = nn.Linear(in_channels * patch_size * patch_size, d_model, **factory)

    def extra_repr(self) -> str:
        overlap = f", overlap={self.overlap}" if self.overlap else ""
        return f"image_size={self.image_size}, patch_size={self.patch_size}, method={self.method!r}{overlap}"

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        images = check_tensor("images", images, min_dim=4)
        expected = (self.in_channels, self.image_size, self.image_size)
        if images.dim() != 4 or tuple(images.shape[1:]) != expected:
            raise ValueError(
                f"images must be (B, C, H, W) = (B, {', '.join(map(str, expected))}), got {shape_str(images.shape)}"
            )
        if self.method == "conv":
            grid = self.proj(images)  # (B, E, H/p, W/p)
            return grid.flatten(2).transpose(1, 2)  # (B, N, E)
        return self.proj(patchify(images, self.patch_size))  # (B, N, E)


class ViTBlock(nn.Module):
    """Pre-norm transformer block: ``x + MHA(LN(x))``, then ``x + MLP(LN(x))`` on ``(B, N, E)``.

    ``layer_norm_eps`` is the LayerNorms' ``eps`` (1e-6, the original ViT's and timm's).
    """

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        mlp_dim: int,
        *,
        dropout: float = 0.0,
        attention_dropout: float = 0.0,
        layer_norm_eps: float = 1e-6,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        self.norm1 = nn.LayerNorm(d_model, eps=layer_norm_eps, **factory)
        self.attention = MultiHeadAttention(d_model, num_heads, dropout=attention_dropout, **factory)
        self.dropout1 = nn.Dropout(dropout)
        self.norm2 = nn.LayerNorm(d_model, eps=layer_norm_eps, **factory)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, mlp_dim, **factory),
            nn.GELU(),
            nn.Dropout(dropout),
            nn.Linear(mlp_dim, d_model, **factory),
            nn.Dropout(dropout),
        )

    def forward(self, x: torch.Tensor, *, need_weights: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``x`` ``(B, N, E)`` -> ``(B, N, E)``, plus the weights ``(B, H, N, N)`` if ``need_weights``."""
        attended = self.attention(self.norm1(x), need_weights=need_weights)
        attended, weights = attended if need_weights else (attended, None)  # (B, N, E)
        x = x + self.dropout1(attended)  # (B, N, E)
        x = x + self.mlp(self.norm2(x))  # (B, N, E)
        return (x, weights) if need_weights else x


class VisionTransformer(nn.Module):
    """A ViT classifier built from a :class:`ViTConfig`.

    ``forward(images)`` -> logits ``(B, num_classes)``;
    ``forward(images, need_weights=True)`` -> ``(logits, maps)`` with one ``(B, H, N+1, N+1)``
    tensor per block (token 0 is the class token).
    """

    def __init__(
        self,
        config: ViTConfig,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(config, ViTConfig):
            raise TypeError(f"config must be a ViTConfig, got {type(config).__name__}")
        factory = {"device": device, "dtype": dtype}
        self.config = config
        self.patch_embedding = PatchEmbedding(
            config.image_size,
            config.patch_size,
            config.in_channels,
            config.d_model,
            method=config.patch_embedding,
            overlap=config.patch_overlap,
            **factory,
        )
        self.class_token = nn.Parameter(torch.zeros(1, 1, config.d_model, **factory))
        if config.position_embedding == "learned":
            self.positions: nn.Module = LearnedPositionalEmbedding(config.num_patches + 1, config.d_model, **factory)
        else:  # fixed 2-D table for the patches, zeros for the class token (MAE)
            side = config.image_size // config.patch_size
            table = sincos_positions_2d(side, side, config.d_model, **factory)  # (N, E)
            self.positions = _FixedPositions(torch.cat((torch.zeros_like(table[:1]), table)))  # (N+1, E)
        self.dropout = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(
            ViTBlock(
                config.d_model,
                config.num_heads,
                config.mlp_dim,
                dropout=config.dropout,
                attention_dropout=config.attention_dropout,
                layer_norm_eps=config.layer_norm_eps,
                **factory,
            )
            for _ in range(config.depth)
        )
        self.norm = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps, **factory)
        self.head = nn.Linear(config.d_model, config.num_classes, **factory)
        self._init_weights()

    def _init_weights(self) -> None:
        """Truncated-normal (std 0.02) linear weights and zero biases, as in the ViT paper's code."""
        nn.init.trunc_normal_(self.class_token, std=0.02)
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.trunc_normal_(module.weight, std=0.02)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)

    def encode(
        self, images: torch.Tensor, *, need_weights: bool = False
    ) -> torch.Tensor | tuple[torch.Tensor, list[torch.Tensor]]:
        """Images ``(B, C, H, W)`` -> normalised tokens ``(B, N+1, E)`` (class token first)."""
        patches = self.patch_embedding(images)  # (B, N, E)
        B = patches.shape[0]
        cls = self.class_token.expand(B, -1, -1)  # (B, 1, E)
        x = self.dropout(self.positions(torch.cat((cls, patches), dim=1)))  # (B, N+1, E)
        maps = []
        for block in self.blocks:
            if need_weights:
                x, weights = block(x, need_weights=True)  # (B, N+1, E), (B, H, N+1, N+1)
                maps.append(weights)
            else:
                x = block(x)  # (B, N+1, E)
        x = self.norm(x)  # (B, N+1, E)
        return (x, maps) if need_weights else x

    def forward(
        self, images: torch.Tensor, *, need_weights: bool = False
    ) -> torch.Tensor | tuple[torch.Tensor, list[torch.Tensor]]:
        encoded = self.encode(images, need_weights=need_weights)
        tokens, maps = encoded if need_weights else (encoded, None)  # (B, N+1, E)
        logits = self.head(tokens[:, 0])  # (B, num_classes), read from the class token
        return (logits, maps) if need_weights else logits


def attention_rollout(maps: list[torch.Tensor] | tuple[torch.Tensor, ...], *, residual: bool = True) -> torch.Tensor:
    """Attention rollout (Abnar & Zuidema, 2020): how much each output token draws on each input token.

    Each layer's maps ``(B, H, N, N)`` are averaged over heads; with ``residual`` the skip
    connection is accounted for as ``0.5 * A + 0.5 * I`` (rows re-normalised); the layers
    are then chained by matrix products, first layer on the right:
    ``R = A_depth @ ... @ A_2 @ A_1``. Returns ``(B, N, N)`` with rows summing to 1.
    Row 0 over columns 1.. is the class token's view of the patches.
    """
    if len(maps) == 0:
        raise ValueError("attention_rollout needs at least one layer's attention maps")
    first = check_tensor("maps[0]", maps[0], min_dim=4)
    B, H, N, N2 = first.shape
    if first.dim() != 4 or N != N2:
        raise ValueError(f"each attention map must be (B, H, N, N), got {shape_str(first.shape)}")
    eye = torch.eye(N, dtype=first.dtype, device=first.device)  # (N, N)
    rollout = eye.expand(B, N, N)  # (B, N, N)
    for index, weights in enumerate(maps):
        if weights.shape != first.shape:
            raise ValueError(f"maps[{index}] has shape {shape_str(weights.shape)}, expected {shape_str(first.shape)}")
        joint = weights.mean(dim=1)  # (B, N, N), heads averaged
        if residual:
            joint = 0.5 * joint + 0.5 * eye  # (B, N, N)
            joint = joint / joint.sum(dim=-1, keepdim=True)  # (B, N, N), rows sum to 1
        rollout = torch.matmul(joint, rollout)  # (B, N, N)
    return rollout
