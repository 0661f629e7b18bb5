"""Offline digits: shapes, dtype, normalisation, a stratified, disjoint and deterministic three-way
split, and the random-shift augmentation."""

from __future__ import annotations

import pytest
import torch

from attn_course.data.images import all_shifts, load_digits_split, random_shift


@pytest.fixture(scope="module")
def split():
    return load_digits_split()


def test_shapes_and_types(split):
    assert split.train_images.shape == (1077, 1, 8, 8)
    assert split.val_images.shape == (270, 1, 8, 8)
    assert split.test_images.shape == (450, 1, 8, 8)
    assert split.train_images.dtype == torch.float32 and split.train_labels.dtype == torch.int64
    assert split.train_labels.shape == (1077,) and split.val_labels.shape == (270,) and split.test_labels.shape == (450,)
    assert set(split.train_labels.tolist()) == set(range(10))


def test_standardised_with_training_statistics(split):
    assert abs(split.train_images.mean().item()) < 1e-5
    assert abs(split.train_images.std().item() - 1.0) < 1e-3
    assert abs(split.val_images.mean().item()) > 1e-4  # the validation set was not standardised with its own statistics
    for images in (split.val_images, split.test_images):
        pixels = split.pixels(images)  # back to [0, 1]
        assert pixels.min().item() > -1e-5 and pixels.max().item() < 1 + 1e-5
        torch.testing.assert_close(pixels * 16, (pixels * 16).round(), atol=1e-4, rtol=0)  # 0..16 integers


def test_stratified(split):
    shares = [torch.bincount(labels, minlength=10) / len(labels) for labels in
              (split.train_labels, split.val_labels, split.test_labels)]
    for share in shares[1:]:
        assert (share - shares[0]).abs().max() < 0.01


def _rows(images: torch.Tensor) -> list[tuple[float, ...]]:
    return [tuple(x.flatten().tolist()) for x in images]


def test_deterministic_and_disjoint(split):
    again = load_digits_split()
    assert torch.equal(again.train_images, split.train_images) and torch.equal(again.val_labels, split.val_labels)
    assert torch.equal(again.test_images, split.test_images)
    other = load_digits_split(seed=1)
    assert not torch.equal(other.test_images, split.test_images)
    # Disjoint: the 1797 images are all different (measured), so no image may be in two sets.
    train, val = set(_rows(split.train_images)), set(_rows(split.val_images))
    assert len(train) == len(split.train_labels)
    assert not train & val and not (train | val) & set(_rows(split.test_images))
    total = len(split.train_labels) + len(split.val_labels) + len(split.test_labels)
    assert total == 1797


def test_test_set_does_not_depend_on_the_validation_fraction(split):
    other = load_digits_split(validation_fraction=0.25)
    assert torch.equal(other.test_labels, split.test_labels)
    assert len(other.val_labels) > len(split.val_labels)


def test_options_and_errors():
    small = load_digits_split(test_fraction=0.5, validation_fraction=0.1, dtype=torch.float64)
    assert small.test_images.dtype == torch.float64 and len(small.test_labels) in (898, 899)
    with pytest.raises(ValueError, match="test_fraction"):
        load_digits_split(test_fraction=1.5)
    with pytest.raises(ValueError, match="validation_fraction"):
        load_digits_split(validation_fraction=0.0)
    with pytest.raises(ValueError, match="leave training images"):
        load_digits_split(validation_fraction=0.5, test_fraction=0.5)
    with pytest.raises(TypeError, match="floating"):
        load_digits_split(dtype=torch.int64)


def test_random_shift_moves_whole_images_by_at_most_max_shift():
    images = torch.zeros(64, 2, 6, 6)
    images[:, 0, 2, 3] = 1.0  # one lit pixel in channel 0, another in channel 1
    images[:, 1, 4, 1] = 2.0
    before = images.clone()
    gen = torch.Generator().manual_seed(0)
    moved = random_shift(images, gen, max_shift=1)
    assert torch.equal(images, before), "random_shift must not modify its input"
    assert moved.shape == images.shape
    seen = set()
    for b in range(64):
        r0, c0 = (moved[b, 0] == 1.0).nonzero()[0].tolist()
        r1, c1 = (moved[b, 1] == 2.0).nonzero()[0].tolist()
        shift = (r0 - 2, c0 - 3)
        assert shift == (r1 - 4, c1 - 1), "both channels move together"
        assert max(abs(shift[0]), abs(shift[1])) <= 1
        assert moved[b].sum() == 3.0  # nothing lost, nothing wrapped around
        seen.add(shift)
    assert len(seen) == 9  # every one of the 3 x 3 shifts happens in 64 draws
    again = random_shift(images, torch.Generator().manual_seed(0), max_shift=1)
    assert torch.equal(again, moved), "the same generator seed gives the same shifts"


def test_random_shift_fills_with_blank_paper_and_checks_its_arguments(split):
    images = split.test_images[:32]
    moved = random_shift(images, torch.Generator().manual_seed(1), max_shift=2)
    assert moved.min() >= images.min() and moved.max() <= images.max()
    assert torch.equal(random_shift(images, max_shift=0), images)
    with pytest.raises(ValueError, match=r"\(B, C, H, W\)"):
        random_shift(images[0])
    with pytest.raises(ValueError, match="max_shift"):
        random_shift(images, max_shift=-1)


def test_all_shifts_gives_every_shift_once_the_unshifted_batch_in_the_middle():
    images = torch.zeros(2, 1, 5, 5)
    images[:, 0, 2, 2] = 1.0  # one lit pixel in the centre
    views = all_shifts(images, max_shift=1)
    assert len(views) == 9 and torch.equal(views[4], images)
    moved = {tuple(((v[0, 0] == 1.0).nonzero()[0] - 2).tolist()) for v in views}
    assert moved == {(dr, dc) for dr in (-1, 0, 1) for dc in (-1, 0, 1)}
    # The same windows random_shift draws from: each random shift is one of the nine views.
    drawn = random_shift(images, torch.Generator().manual_seed(3))
    assert any(torch.equal(drawn[0], v[0]) for v in views)
    assert len(all_shifts(images, max_shift=2)) == 25 and torch.equal(all_shifts(images, max_shift=0)[0], images)
