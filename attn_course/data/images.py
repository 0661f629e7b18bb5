"""Real images, offline: scikit-learn's bundled 8x8 handwritten digits (no download).

``sklearn.datasets.load_digits`` ships 1797 greyscale images of the digits 0-9 (pixel values
0..16) inside the scikit-learn package. :func:`load_digits_split` turns them into float
tensors ``(N, 1, 8, 8)``, standardised with the *training* set's mean and standard
deviation, and splits them into train and test sets that are stratified (each digit keeps
its share in both) and deterministic for a given seed.

Taught in lesson 09 (Vision Transformer).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["DigitsSplit", "load_digits_split", "DIGIT_CLASSES"]

DIGIT_CLASSES: tuple[str, ...] = tuple(str(d) for d in range(10))


@dataclass(frozen=True)
class DigitsSplit:
    """Train/test tensors of the digits: images ``(N, 1, 8, 8)`` float, labels ``(N,)`` int64.

    ``mean`` and ``std`` are the training-set statistics used to standardise both sets
    (pixel values were first scaled from 0..16 to 0..1); undo with ``images * std + mean``.
    """

    train_images: torch.Tensor
    train_labels: torch.Tensor
    test_images: torch.Tensor
    test_labels: torch.Tensor
    mean: float
    std: float

    def to(self, device: torch.device | str) -> DigitsSplit:
        """The same split with every tensor moved to ``device``."""
        return DigitsSplit(
            self.train_images.to(device),
            self.train_labels.to(device),
            self.test_images.to(device),
            self.test_labels.to(device),
            self.mean,
            self.std,
        )


def load_digits_split(
    *, test_fraction: float = 0.25, seed: int = 0, dtype: torch.dtype = torch.float32
) -> DigitsSplit:
    """Load the 1797 digits and split them, stratified by class, deterministically by ``seed``.

    With the default ``test_fraction=0.25``: 1347 training and 450 test images.
    """
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {type(seed).__name__}")
    if not dtype.is_floating_point:
        raise TypeError(f"dtype must be floating point, got {dtype}")
    digits = load_digits()
    images = torch.as_tensor(digits.images, dtype=torch.float64) / 16.0  # (1797, 8, 8), in [0, 1]
    labels = torch.as_tensor(digits.target, dtype=torch.int64)  # (1797,)
    train_index, test_index = train_test_split(
        torch.arange(len(labels)).numpy(), test_size=test_fraction, random_state=seed, stratify=labels.numpy()
    )
    train_index, test_index = torch.as_tensor(train_index), torch.as_tensor(test_index)
    train = images[train_index]  # (N_train, 8, 8)
    mean, std = train.mean().item(), train.std().item()

    def prepare(x: torch.Tensor) -> torch.Tensor:
        return ((x - mean) / std).unsqueeze(1).to(dtype)  # (N, 1, 8, 8)

    return DigitsSplit(
        prepare(train), labels[train_index], prepare(images[test_index]), labels[test_index], mean, std
    )
