"""Offline digits: shapes, dtype, normalisation, stratified and deterministic split."""

from __future__ import annotations

import pytest
import torch

from attn_course.data.images import load_digits_split


@pytest.fixture(scope="module")
def split():
    return load_digits_split()


def test_shapes_and_types(split):
    assert split.train_images.shape == (1347, 1, 8, 8) and split.test_images.shape == (450, 1, 8, 8)
    assert split.train_images.dtype == torch.float32 and split.train_labels.dtype == torch.int64
    assert split.train_labels.shape == (1347,) and split.test_labels.shape == (450,)
    assert set(split.train_labels.tolist()) == set(range(10))


def test_standardised_with_training_statistics(split):
    assert abs(split.train_images.mean().item()) < 1e-5
    assert abs(split.train_images.std().item() - 1.0) < 1e-3
    pixels = split.test_images * split.std + split.mean  # back to [0, 1]
    assert pixels.min().item() > -1e-5 and pixels.max().item() < 1 + 1e-5
    torch.testing.assert_close(pixels * 16, (pixels * 16).round(), atol=1e-4, rtol=0)  # 0..16 integers


def test_stratified(split):
    train_share = torch.bincount(split.train_labels, minlength=10) / len(split.train_labels)
    test_share = torch.bincount(split.test_labels, minlength=10) / len(split.test_labels)
    assert (train_share - test_share).abs().max() < 0.01


def test_deterministic_and_disjoint(split):
    again = load_digits_split()
    assert torch.equal(again.train_images, split.train_images) and torch.equal(again.test_labels, split.test_labels)
    other = load_digits_split(seed=1)
    assert not torch.equal(other.test_images, split.test_images)
    train = {tuple(x.flatten().tolist()) for x in split.train_images}
    overlap = sum(tuple(x.flatten().tolist()) in train for x in split.test_images)
    assert overlap < 5  # the digits set has a few exact duplicate images, nothing more


def test_options_and_errors():
    small = load_digits_split(test_fraction=0.5, dtype=torch.float64)
    assert small.test_images.dtype == torch.float64 and len(small.test_labels) in (898, 899)
    with pytest.raises(ValueError, match="test_fraction"):
        load_digits_split(test_fraction=1.5)
    with pytest.raises(TypeError, match="floating"):
        load_digits_split(dtype=torch.int64)
