"""Real images, offline: scikit-learn's bundled 8x8 handwritten digits (no download).

``sklearn.datasets.load_digits`` ships 1797 greyscale images of the digits 0-9 (pixel values
0..16) inside the scikit-learn package. :func:`load_digits_split` turns them into float
tensors ``(N, 1, 8, 8)``, standardised with the *training* set's mean and standard
deviation, and splits them three ways: a training set (fits the weights), a validation set
(chooses everything: model size, learning rate, epochs, the baselines' settings) and a test
set (read once, at the end). The splits are stratified (each digit keeps its share in all
three) and deterministic for a given seed.

:func:`random_shift` is the one augmentation the lesson uses: every image moved by up to
``max_shift`` pixels in each direction, a cheap way to teach a model that a digit one pixel
to the left is the same digit. :func:`all_shifts` gives every such shifted copy of a batch, to
average a model's predictions over them at test time (``attn_course.training.predict(...,
views=all_shifts)``).

Taught in lesson 09 (Vision Transformer).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = ["DigitsSplit", "load_digits_split", "random_shift", "all_shifts", "DIGIT_CLASSES"]

DIGIT_CLASSES: tuple[str, ...] = tuple(str(d) for d in range(10))


@dataclass(frozen=True)
class DigitsSplit:
    """Train/validation/test tensors of the digits: images ``(N, 1, 8, 8)`` float, labels ``(N,)`` int64.

    ``mean`` and ``std`` are the training-set statistics used to standardise all three sets
    (pixel values were first scaled from 0..16 to 0..1); undo with ``images * std + mean``.
    """

    train_images: torch.Tensor
    train_labels: torch.Tensor
    val_images: torch.Tensor
    val_labels: torch.Tensor
    test_images: torch.Tensor
    test_labels: torch.Tensor
    mean: float
    std: float

    def to(self, device: torch.device | str) -> DigitsSplit:
        """The same split with every tensor moved to ``device``."""
        return DigitsSplit(
            self.train_images.to(device),
            self.train_labels.to(device),
            self.val_images.to(device),
            self.val_labels.to(device),
            self.test_images.to(device),
            self.test_labels.to(device),
            self.mean,
            self.std,
        )

    def pixels(self, images: torch.Tensor) -> torch.Tensor:
        """Standardised ``images`` back to ink in ``[0, 1]`` (0 = blank paper), e.g. for plots."""
        return images * self.std + self.mean


def load_digits_split(
    *,
    validation_fraction: float = 0.15,
    test_fraction: float = 0.25,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
) -> DigitsSplit:
    """Load the 1797 digits and split them three ways, stratified by class, deterministically by ``seed``.

    ``validation_fraction`` and ``test_fraction`` are fractions of all 1797 images. With the
    defaults (0.15 and 0.25): 1077 training, 270 validation and 450 test images. The test set
    does not depend on ``validation_fraction``: it is cut first.
    """
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    for name, value in (("validation_fraction", validation_fraction), ("test_fraction", test_fraction)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 < value < 1.0:
            raise ValueError(f"{name} must be in (0, 1), got {value!r}")
    if validation_fraction + test_fraction >= 1.0:
        raise ValueError(
            f"validation_fraction + test_fraction must leave training images, got "
            f"{validation_fraction} + {test_fraction} = {validation_fraction + test_fraction}"
        )
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {type(seed).__name__}")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating-point torch.dtype, got {dtype}")
    digits = load_digits()
    images = torch.as_tensor(digits.images, dtype=torch.float64) / 16.0  # (1797, 8, 8), in [0, 1]
    labels = digits.target  # (1797,) numpy, for the stratified splits
    everything = torch.arange(len(labels)).numpy()
    rest, test_index = train_test_split(everything, test_size=test_fraction, random_state=seed, stratify=labels)
    train_index, val_index = train_test_split(
        rest, test_size=validation_fraction / (1.0 - test_fraction), random_state=seed, stratify=labels[rest]
    )
    labels = torch.as_tensor(labels, dtype=torch.int64)
    train = images[torch.as_tensor(train_index)]  # (N_train, 8, 8)
    mean, std = train.mean().item(), train.std().item()

    def prepare(index) -> tuple[torch.Tensor, torch.Tensor]:
        index = torch.as_tensor(index)
        return ((images[index] - mean) / std).unsqueeze(1).to(dtype), labels[index]  # (N, 1, 8, 8), (N,)

    return DigitsSplit(*prepare(train_index), *prepare(val_index), *prepare(test_index), mean, std)


def _shift(images: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, m: int) -> torch.Tensor:
    """Each image ``b`` moved so that its window starts at ``(rows[b], cols[b])`` of the ``m``-padded image."""
    B, C, H, W = images.shape
    padded = F.pad(images, (m, m, m, m), value=float(images.min()))  # (B, C, H + 2m, W + 2m)
    row_index = rows[:, None] + torch.arange(H, device=images.device)  # (B, H)
    col_index = cols[:, None] + torch.arange(W, device=images.device)  # (B, W)
    batch = torch.arange(B, device=images.device)[:, None, None]  # (B, 1, 1)
    window = padded.permute(0, 2, 3, 1)[batch, row_index[:, :, None], col_index[:, None, :]]  # (B, H, W, C)
    return window.permute(0, 3, 1, 2).contiguous()  # (B, C, H, W)


def _check_images_and_shift(images: object, max_shift: object) -> None:
    if not isinstance(images, torch.Tensor) or images.dim() != 4:
        got = tuple(images.shape) if isinstance(images, torch.Tensor) else type(images).__name__
        raise ValueError(f"images must be a tensor (B, C, H, W), got {got}")
    if isinstance(max_shift, bool) or not isinstance(max_shift, int) or max_shift < 0:
        raise ValueError(f"max_shift must be an int >= 0, got {max_shift!r}")


def random_shift(images: torch.Tensor, generator: torch.Generator | None = None, *, max_shift: int = 1) -> torch.Tensor:
    """Move each image ``(B, C, H, W)`` by a random whole number of pixels, at most ``max_shift`` each way.

    The pixels that come in from outside are filled with the batch's smallest value (blank
    paper for standardised digits), nothing wraps around. Each image draws its own vertical
    and horizontal shift from ``generator``; the input is not modified.
    """
    _check_images_and_shift(images, max_shift)
    if max_shift == 0:
        return images.clone()
    offsets = torch.randint(0, 2 * max_shift + 1, (2, images.shape[0]), generator=generator)  # (2, B): rows, columns
    offsets = offsets.to(images.device)
    return _shift(images, offsets[0], offsets[1], max_shift)


def all_shifts(images: torch.Tensor, *, max_shift: int = 1) -> list[torch.Tensor]:
    """Every copy of ``images`` ``(B, C, H, W)`` moved by whole pixels, at most ``max_shift`` each way.

    ``(2 max_shift + 1)^2`` tensors, the unshifted batch in the middle; filled like
    :func:`random_shift`. Used to average a model's predictions over the shifts it was trained
    on (test-time augmentation).
    """
    _check_images_and_shift(images, max_shift)
    B, m = images.shape[0], max_shift
    views = []
    for dr in range(2 * m + 1):
        for dc in range(2 * m + 1):
            rows = torch.full((B,), dr, device=images.device)  # (B,)
            cols = torch.full((B,), dc, device=images.device)  # (B,)
            views.append(_shift(images, rows, cols, m) if m else images.clone())
    return views
