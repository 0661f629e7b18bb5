"""Conformer (Gulati et al., 2020): self-attention for global context, convolution for local detail.

One Conformer block on frames ``x`` ``(B, T, E)`` ("macaron" layout, two half-step FFNs)::

    x = x + 1/2 * FeedForward(x)            LayerNorm, Linear E->4E, Swish, dropout, Linear 4E->E, dropout
    x = x + MultiHeadSelfAttention(x)       LayerNorm, relative-position MHSA (Transformer-XL), dropout
    x = x + Convolution(x)                  LayerNorm, pointwise conv E->2E, GLU, depthwise conv,
                                            BatchNorm, Swish, pointwise conv E->E, dropout
    x = x + 1/2 * FeedForward(x)
    x = LayerNorm(x)

The source article's ``ConformerBlock`` ran FFN -> convolution -> attention -> FFN, had no
normalisation at all and used modules it never defined; this is the paper's order.

The encoder first shrinks time 4x with two 3x3 convolutions of stride 2 (the lengths are
updated to match), projects to ``d_model`` and runs the blocks; the classifier averages
the valid frames and applies a linear head.

**Padding.** A batch pads its clips to one length ``T``; ``lengths`` says how many frames
are real. In evaluation mode padded frames never change the outputs at real frames:
attention masks padded keys, the feed-forward and normalisation layers work frame by
frame, the depthwise convolution sees zeros at padded frames (exactly as at the ends of an
unpadded clip), the subsampling convolutions have no padding, so a real output frame only
reads real input frames, and the classifier pools real frames only. In **training** mode a
plain ``BatchNorm1d`` would also average the padded frames into its batch statistics (and
so into every output); :class:`MaskedBatchNorm1d` computes them over real frames only.

Shape legend: B batch, T frames (input), T' frames after subsampling, F mel features,
H heads, E model dim (``d_model``).

Taught in lesson 10 (Conformer).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn as nn
import torch.nn.functional as F

from ._checks import check_positive_int, check_tensor, shape_str
from .masks import padding_mask
from .multihead import MultiHeadAttention
from .positional import RelativePositionMultiHeadAttention, sinusoidal_encoding

__all__ = [
    "ConformerConfig",
    "DTMF_TRAINING",
    "FeedForwardModule",
    "SelfAttentionModule",
    "ConvolutionModule",
    "MaskedBatchNorm1d",
    "ConformerBlock",
    "ConvSubsampling",
    "ConformerEncoder",
    "ConformerClassifier",
]


@dataclass(frozen=True)
class ConformerConfig:
    """Every size and switch of a Conformer encoder / classifier.

    Attributes:
        n_mels: features F per input frame (mel bands of the spectrogram).
        num_classes: outputs of :class:`ConformerClassifier`'s head.
        d_model: model dim E.
        num_layers: number of Conformer blocks.
        num_heads: attention heads H; must divide ``d_model``.
        ff_expansion: hidden width of the feed-forward modules, as a multiple of E (4 in the paper).
        conv_kernel_size: kernel of the depthwise convolution (odd, so that it is centred).
        subsampling_channels: channels of the two stride-2 subsampling convolutions.
        dropout: dropout in every module (feed-forward, attention output and weights,
            convolution module, after the input projection).
        positions: ``"relative"`` (the paper: Transformer-XL relative positions inside
            attention), ``"absolute"`` (sinusoidal table added once after subsampling) or
            ``"none"`` -- the last two for ablations.
        use_convolution: keep the convolution module; ``False`` drops it (ablation).
        masked_batch_norm: compute training-mode BatchNorm statistics over real frames only;
            ``False`` uses ``nn.BatchNorm1d`` over every frame, padding included.
    """

    n_mels: int = 24
    num_classes: int = 12
    d_model: int = 48
    num_layers: int = 2
    num_heads: int = 4
    ff_expansion: int = 4
    conv_kernel_size: int = 15
    subsampling_channels: int = 16
    dropout: float = 0.0
    positions: Literal["relative", "absolute", "none"] = "relative"
    use_convolution: bool = True
    masked_batch_norm: bool = True

    def __post_init__(self) -> None:
        for name in (
            "n_mels",
            "num_classes",
            "d_model",
            "num_layers",
            "num_heads",
            "ff_expansion",
            "conv_kernel_size",
            "subsampling_channels",
        ):
            check_positive_int(f"ConformerConfig.{name}", getattr(self, name))
        if self.d_model % self.num_heads:
            raise ValueError(f"num_heads={self.num_heads} must divide d_model={self.d_model}")
        if self.d_model % 2:
            raise ValueError(f"d_model must be even (sinusoidal positions come in pairs), got {self.d_model}")
        if self.conv_kernel_size % 2 == 0:
            raise ValueError(f"conv_kernel_size must be odd (a centred 'same' convolution), got {self.conv_kernel_size}")
        if self.n_mels < 7:
            raise ValueError(f"n_mels must be >= 7 to survive two stride-2 3x3 convolutions, got {self.n_mels}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        if self.positions not in ("relative", "absolute", "none"):
            raise ValueError(f"positions must be 'relative', 'absolute' or 'none', got {self.positions!r}")

    @classmethod
    def dtmf(cls) -> ConformerConfig:
        """The lesson-10 model for the DTMF "last key" task (``attn_course.data.audio.DTMF_TASK``).

        Input: 24 log-mel bands every 20 ms, clips of 1.3-1.5 s (66-76 frames, 15-18 after
        subsampling). E = 48, one Conformer block of 4 heads, feed-forward width 2E, depthwise
        kernel 3, no dropout (none was needed to reach the accuracy below, although the same 480
        clips are seen for 8 epochs): about 42 k parameters, so that lesson 10 can train a dozen of
        them on a laptop CPU. With kernel 3 the convolutions see 0.31 s of audio at once, less
        than the 0.32 s between two presses, so no convolution window holds both presses. The
        first and last frames' windows also see the clip's ends (the depthwise convolution's zero
        padding), which would let a press near an end be placed without attention: the task's
        ``margin_seconds=0.3`` keeps presses out of the windows that see the convolution's padding
        (about 0.22 s from the start, up to 0.30 s from the end, where the subsampling drops up to
        three trailing frames); the spectrogram's own edge frames reach slightly further, which
        lesson 10 counts. Chosen on validation accuracy (not on the test set); lesson 10 measures it,
        its ablations and their spread over three seeds on your machine.
        """
        return cls(
            n_mels=24,
            num_classes=12,
            d_model=48,
            num_layers=1,
            num_heads=4,
            ff_expansion=2,
            conv_kernel_size=3,
            subsampling_channels=8,
            dropout=0.0,
        )


#: Keyword arguments for ``attn_course.training.fit`` that go with ``ConformerConfig.dtmf()``
#: (8 epochs of 480 clips: 240 steps of 16 clips).
DTMF_TRAINING: dict[str, float | int] = {"epochs": 8, "batch_size": 16, "lr": 3e-3, "warmup_steps": 10, "weight_decay": 0.01}


def _check_frames(x: object, d_model: int) -> torch.Tensor:
    x = check_tensor("x", x, min_dim=3)
    if x.dim() != 3 or x.shape[-1] != d_model:
        raise ValueError(f"x must be (B, T, E={d_model}), got shape {shape_str(x.shape)}")
    return x


def _check_keep(keep: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor | None:
    """``keep`` is the bool ``(B, T)`` frame mask, True = real frame."""
    if keep is None:
        return None
    if not isinstance(keep, torch.Tensor) or keep.dtype != torch.bool:
        got = keep.dtype if isinstance(keep, torch.Tensor) else type(keep).__name__
        raise TypeError(f"the frame mask must be a bool tensor (True = real frame), got {got}")
    if keep.shape != x.shape[:2]:
        raise ValueError(f"the frame mask must be (B, T) = {shape_str(x.shape[:2])}, got {shape_str(keep.shape)}")
    return keep


class FeedForwardModule(nn.Module):
    """LayerNorm -> Linear(E, expansion E) -> Swish -> dropout -> Linear(expansion E, E) -> dropout."""

    def __init__(self, d_model: int, *, expansion: int = 4, dropout: float = 0.1, device=None, dtype=None) -> None:
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        self.norm = nn.LayerNorm(d_model, **factory)
        self.linear1 = nn.Linear(d_model, expansion * d_model, **factory)
        self.linear2 = nn.Linear(expansion * d_model, d_model, **factory)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.dropout(F.silu(self.linear1(self.norm(x))))  # (B, T, 4E); SiLU = Swish
        return self.dropout(self.linear2(hidden))  # (B, T, E)


class SelfAttentionModule(nn.Module):
    """LayerNorm -> multi-head self-attention (relative positions or plain) -> dropout."""

    def __init__(
        self, d_model: int, num_heads: int, *, relative: bool = True, dropout: float = 0.1, device=None, dtype=None
    ) -> None:
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        self.norm = nn.LayerNorm(d_model, **factory)
        self.relative = relative
        if relative:
            self.attention: MultiHeadAttention = RelativePositionMultiHeadAttention(
                d_model, num_heads, dropout=dropout, **factory
            )
        else:
            self.attention = MultiHeadAttention(d_model, num_heads, dropout=dropout, **factory)
        self.dropout = nn.Dropout(dropout)

    def forward(
        self, x: torch.Tensor, keep: torch.Tensor | None = None, *, need_weights: bool = False
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``x`` ``(B, T, E)``, ``keep`` ``(B, T)`` -> ``(B, T, E)`` (and weights ``(B, H, T, T)``)."""
        mask = None if keep is None else keep[:, None, None, :]  # (B, 1, 1, T): padded keys blocked
        normed = self.norm(x)  # (B, T, E)
        attended = self.attention(normed, mask=mask, need_weights=need_weights)  # same call for both kinds
        out, weights = attended if need_weights else (attended, None)  # (B, T, E)
        out = self.dropout(out)
        return (out, weights) if need_weights else out


def _check_channel_keep(keep: torch.Tensor | None, x: torch.Tensor) -> None:
    """``keep`` is None or the bool ``(B, T)`` frame mask of channels-first ``x`` ``(B, C, T)``."""
    if keep is None:
        return
    if not isinstance(keep, torch.Tensor) or keep.dtype != torch.bool or x.dim() != 3 or keep.shape != (x.shape[0], x.shape[2]):
        got = f"{keep.dtype} {shape_str(keep.shape)}" if isinstance(keep, torch.Tensor) else type(keep).__name__
        raise ValueError(f"keep must be a bool (B, T) frame mask for x (B, C, T) = {shape_str(x.shape)}, got {got}")


class MaskedBatchNorm1d(nn.BatchNorm1d):
    """``BatchNorm1d`` over ``(B, C, T)`` whose batch statistics skip padded frames.

    ``forward(x, keep)`` with ``keep`` ``(B, T)`` (True = real frame): wherever
    ``nn.BatchNorm1d`` would normalise with the statistics of the batch (training mode, or any
    mode with ``track_running_stats=False``) the mean and variance come from real frames only,
    and in training the running statistics are updated with them (unbiased variance, like
    PyTorch). With running statistics in evaluation mode, or with ``keep=None``, it is exactly
    ``nn.BatchNorm1d``.

    What the mask buys: a clip's training-mode outputs no longer depend on how much padding its
    batch holds (which depends on the longest clip that happens to share the batch). They still
    depend on the other clips' real frames -- that is what batch statistics are.

    The paper (Gulati et al., 2020) says nothing about padding. Google's Lingvo, the authors'
    toolkit, does the same as this class (its ``BatchNormLayer`` computes the moments over valid
    frames only); ESPnet and torchaudio, whose convolution module uses a plain ``BatchNorm1d``
    over every frame, do not. Lesson 10 shows the difference and measures it.
    """

    def forward(self, x: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:  # type: ignore[override]
        _check_channel_keep(keep, x)
        batch_statistics = self.training or not self.track_running_stats  # as nn.BatchNorm1d decides
        if keep is None or not batch_statistics:
            return super().forward(x)
        weight = keep[:, None, :].to(x.dtype)  # (B, 1, T)
        count = weight.sum()
        if count < 2:
            raise ValueError(f"masked BatchNorm needs at least 2 real frames in the batch, got {int(count)}")
        mean = (x * weight).sum(dim=(0, 2)) / count  # (C,)
        centred = (x - mean[None, :, None]) * weight  # (B, C, T), zero at padding
        var = centred.square().sum(dim=(0, 2)) / count  # (C,), biased: used to normalise
        if self.training and self.track_running_stats:
            with torch.no_grad():
                self.num_batches_tracked.add_(1)
                momentum = self.momentum if self.momentum is not None else 1.0 / float(self.num_batches_tracked)
                self.running_mean.lerp_(mean.detach().to(self.running_mean.dtype), momentum)
                unbiased = var.detach() * count / (count - 1)
                self.running_var.lerp_(unbiased.to(self.running_var.dtype), momentum)
        out = (x - mean[None, :, None]) / torch.sqrt(var[None, :, None] + self.eps)  # (B, C, T)
        if self.affine:
            out = out * self.weight[None, :, None] + self.bias[None, :, None]  # (B, C, T)
        return out


class ConvolutionModule(nn.Module):
    """LayerNorm -> pointwise conv E->2E -> GLU -> depthwise conv -> BatchNorm -> Swish -> pointwise conv -> dropout.

    Padded frames are set to zero right before the depthwise convolution, so a real frame
    next to the padding sees the same zeros as at the end of an unpadded clip.

    The depthwise convolution is centred (``kernel_size // 2`` zeros on each side: output
    frame t reads frames t - K//2 .. t + K//2). With ``causal=True`` it pads ``kernel_size - 1``
    zeros on the left only, so frame t reads frames t - K + 1 .. t and never the future, as
    streaming recognisers need; everything else in the module works frame by frame.
    """

    def __init__(
        self,
        d_model: int,
        *,
        kernel_size: int = 15,
        dropout: float = 0.1,
        masked_batch_norm: bool = True,
        causal: bool = False,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        check_positive_int("kernel_size", kernel_size)
        if not causal and kernel_size % 2 == 0:
            raise ValueError(f"a centred depthwise convolution needs an odd kernel_size, got {kernel_size}")
        factory = {"device": device, "dtype": dtype}
        self.causal = causal
        self.norm = nn.LayerNorm(d_model, **factory)
        self.pointwise1 = nn.Conv1d(d_model, 2 * d_model, kernel_size=1, **factory)
        self.depthwise = nn.Conv1d(
            d_model, d_model, kernel_size=kernel_size, padding=0 if causal else kernel_size // 2, groups=d_model,
            **factory,
        )
        self.masked_batch_norm = masked_batch_norm
        self.batch_norm = (MaskedBatchNorm1d if masked_batch_norm else nn.BatchNorm1d)(d_model, **factory)
        self.pointwise2 = nn.Conv1d(d_model, d_model, kernel_size=1, **factory)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
        """``x`` ``(B, T, E)``, ``keep`` ``(B, T)`` (True = real frame) -> ``(B, T, E)``."""
        x = _check_frames(x, self.norm.normalized_shape[0])
        keep = _check_keep(keep, x)
        y = self.norm(x).transpose(1, 2)  # (B, E, T): Conv1d wants channels first
        y = F.glu(self.pointwise1(y), dim=1)  # (B, 2E, T) -> (B, E, T)
        if keep is not None:
            y = y.masked_fill(~keep[:, None, :], 0.0)  # (B, E, T), padded frames zeroed
        if self.causal:
            y = F.pad(y, (self.depthwise.kernel_size[0] - 1, 0))  # (B, E, K-1+T): zeros before the clip only
        y = self.depthwise(y)  # (B, E, T)
        if self.masked_batch_norm:
            y = self.batch_norm(y, keep)  # (B, E, T)
        else:
            y = self.batch_norm(y)  # (B, E, T)
        y = self.pointwise2(F.silu(y))  # (B, E, T)
        return self.dropout(y.transpose(1, 2))  # (B, T, E)


class ConformerBlock(nn.Module):
    """One Conformer block: FFN/2 -> MHSA -> convolution -> FFN/2 -> LayerNorm, each with a residual."""

    def __init__(self, config: ConformerConfig, *, device=None, dtype=None) -> None:
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        E = config.d_model
        self.feed_forward1 = FeedForwardModule(E, expansion=config.ff_expansion, dropout=config.dropout, **factory)
        self.attention = SelfAttentionModule(
            E, config.num_heads, relative=config.positions == "relative", dropout=config.dropout, **factory
        )
        self.convolution = (
            ConvolutionModule(
                E,
                kernel_size=config.conv_kernel_size,
                dropout=config.dropout,
                masked_batch_norm=config.masked_batch_norm,
                **factory,
            )
            if config.use_convolution
            else None
        )
        self.feed_forward2 = FeedForwardModule(E, expansion=config.ff_expansion, dropout=config.dropout, **factory)
        self.final_norm = nn.LayerNorm(E, **factory)

    def forward(
        self, x: torch.Tensor, keep: torch.Tensor | None = None, *, need_weights: bool = False
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``x`` ``(B, T, E)``, ``keep`` ``(B, T)`` (True = real frame) -> ``(B, T, E)``."""
        x = _check_frames(x, self.final_norm.normalized_shape[0])
        keep = _check_keep(keep, x)
        x = x + 0.5 * self.feed_forward1(x)  # (B, T, E)
        attended = self.attention(x, keep, need_weights=need_weights)
        attended, weights = attended if need_weights else (attended, None)  # (B, T, E)
        x = x + attended  # (B, T, E)
        if self.convolution is not None:
            x = x + self.convolution(x, keep)  # (B, T, E)
        x = x + 0.5 * self.feed_forward2(x)  # (B, T, E)
        x = self.final_norm(x)  # (B, T, E)
        return (x, weights) if need_weights else x


class ConvSubsampling(nn.Module):
    """Two ``3x3`` convolutions with stride 2 (and ReLU) over (time, frequency): ``(B, T, F) -> (B, T', C F')``.

    No padding, so ``T' = ((T - 1) // 2 - 1) // 2`` and each output frame reads only input
    frames inside the clip: with :meth:`output_lengths` the padding never leaks in.
    """

    def __init__(self, n_mels: int, channels: int, *, device=None, dtype=None) -> None:
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        self.conv1 = nn.Conv2d(1, channels, kernel_size=3, stride=2, **factory)
        self.conv2 = nn.Conv2d(channels, channels, kernel_size=3, stride=2, **factory)
        self.out_features = channels * self.output_lengths(torch.tensor(n_mels)).item()

    @staticmethod
    def output_lengths(lengths: torch.Tensor) -> torch.Tensor:
        """Frames left after the two convolutions: ``L -> (L - 1) // 2`` twice (0 if too short)."""
        lengths = (lengths - 1).div(2, rounding_mode="floor").clamp(min=0)
        return (lengths - 1).div(2, rounding_mode="floor").clamp(min=0)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        x = self.conv1(features[:, None])  # (B, 1, T, F) -> (B, C, T1, F1)
        x = self.conv2(F.relu(x))  # (B, C, T', F')
        x = F.relu(x)
        return x.permute(0, 2, 1, 3).flatten(2)  # (B, T', C F')


class ConformerEncoder(nn.Module):
    """Log-mel frames ``(B, T, F)`` -> encoded frames ``(B, T', E)`` and their lengths ``(B,)``."""

    def __init__(self, config: ConformerConfig, *, device=None, dtype=None) -> None:
        super().__init__()
        if not isinstance(config, ConformerConfig):
            raise TypeError(f"config must be a ConformerConfig, got {type(config).__name__}")
        factory = {"device": device, "dtype": dtype}
        self.config = config
        self.subsampling = ConvSubsampling(config.n_mels, config.subsampling_channels, **factory)
        self.input_projection = nn.Linear(self.subsampling.out_features, config.d_model, **factory)
        self.dropout = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(ConformerBlock(config, **factory) for _ in range(config.num_layers))

    def forward(
        self, features: torch.Tensor, lengths: torch.Tensor | None = None, *, need_weights: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor] | tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
        """``features`` ``(B, T, F)``; ``lengths`` ``(B,)`` real frames per clip (default: all ``T``).

        Returns ``(encoded (B, T', E), lengths' (B,))``, plus per-block attention weights
        ``(B, H, T', T')`` with ``need_weights``.
        """
        features = check_tensor("features", features, min_dim=3)
        if features.dim() != 3 or features.shape[-1] != self.config.n_mels:
            raise ValueError(
                f"features must be (B, T, F={self.config.n_mels}) log-mel frames, got shape {shape_str(features.shape)}"
            )
        B, T, _ = features.shape
        if lengths is None:
            lengths = torch.full((B,), T, device=features.device, dtype=torch.long)
        if not isinstance(lengths, torch.Tensor) or lengths.shape != (B,) or lengths.dtype.is_floating_point:
            raise ValueError(f"lengths must be an integer tensor of shape (B,) = ({B},), got {lengths!r}")
        if (lengths > T).any() or (lengths < 1).any():
            raise ValueError(f"lengths must be in [1, T={T}], got {lengths.tolist()}")
        keep_in = padding_mask(lengths, T)  # (B, T)
        features = features.masked_fill(~keep_in[:, :, None], 0.0)  # (B, T, F), padding zeroed
        x = self.input_projection(self.subsampling(features))  # (B, T', E)
        out_lengths = ConvSubsampling.output_lengths(lengths)  # (B,)
        if (out_lengths < 1).any():
            raise ValueError(f"clips need at least 7 frames to survive the 4x subsampling, got lengths {lengths.tolist()}")
        keep = padding_mask(out_lengths, x.shape[1])  # (B, T')
        x = self.dropout(x)
        if self.config.positions == "absolute":
            positions = torch.arange(x.shape[1], device=x.device, dtype=torch.float32)  # (T',), exact
            x = x + sinusoidal_encoding(positions, self.config.d_model).to(x.dtype)  # (B, T', E)
        maps = []
        for block in self.blocks:
            if need_weights:
                x, weights = block(x, keep, need_weights=True)  # (B, T', E), (B, H, T', T')
                maps.append(weights)
            else:
                x = block(x, keep)  # (B, T', E)
        return (x, out_lengths, maps) if need_weights else (x, out_lengths)


class ConformerClassifier(nn.Module):
    """A :class:`ConformerEncoder`, a mean over the real frames, and a linear head: ``(B, T, F) -> (B, classes)``."""

    def __init__(self, config: ConformerConfig, *, device=None, dtype=None) -> None:
        super().__init__()
        self.config = config
        self.encoder = ConformerEncoder(config, device=device, dtype=dtype)
        self.head = nn.Linear(config.d_model, config.num_classes, device=device, dtype=dtype)

    def forward(self, features: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
        encoded, out_lengths = self.encoder(features, lengths)  # (B, T', E), (B,)
        keep = padding_mask(out_lengths, encoded.shape[1])[:, :, None].to(encoded.dtype)  # (B, T', 1)
        pooled = (encoded * keep).sum(dim=1) / keep.sum(dim=1)  # (B, E), mean over real frames
        return self.head(pooled)  # (B, classes)
