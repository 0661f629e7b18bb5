"""Conformer: block order, modules, padding invariance, masked BatchNorm, every config field used."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn as nn

from attn_course.conformer import (
    ConformerBlock,
    ConformerClassifier,
    ConformerConfig,
    ConformerEncoder,
    ConvolutionModule,
    ConvSubsampling,
    MaskedBatchNorm1d,
)
from attn_course.masks import padding_mask
from attn_course.multihead import MultiHeadAttention
from attn_course.positional import RelativePositionMultiHeadAttention

SMALL = ConformerConfig(
    n_mels=12,
    num_classes=5,
    d_model=16,
    num_layers=2,
    num_heads=2,
    ff_expansion=2,
    conv_kernel_size=5,
    subsampling_channels=4,
    dropout=0.1,
)


def make(cls=ConformerClassifier, config: ConformerConfig = SMALL, *, seed: int = 0, device="cpu"):
    torch.manual_seed(seed)
    model = cls(config, dtype=torch.float64, device=device)
    # Non-trivial BatchNorm running statistics, so that evaluation mode is really tested.
    for module in model.modules():
        if isinstance(module, nn.BatchNorm1d):
            with torch.no_grad():
                module.running_mean.uniform_(-1, 1)
                module.running_var.uniform_(0.5, 2)
    return model


def features(B=3, T=40, F=SMALL.n_mels, *, seed=1, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(B, T, F, generator=gen, dtype=torch.float64).to(device)


# ---------------------------------------------------------------- the block


def test_block_follows_the_paper_order():
    torch.manual_seed(0)
    block = ConformerBlock(SMALL, dtype=torch.float64).eval()
    x = torch.randn(2, 9, SMALL.d_model, dtype=torch.float64)
    y = x + 0.5 * block.feed_forward1(x)
    y = y + block.attention(y)
    y = y + block.convolution(y)
    y = y + 0.5 * block.feed_forward2(y)
    torch.testing.assert_close(block(x), block.final_norm(y), atol=1e-12, rtol=1e-12)
    # The article's order (convolution before attention, no final norm) is a different function.
    z = x + 0.5 * block.feed_forward1(x)
    z = z + block.convolution(z)
    z = z + block.attention(z)
    z = z + 0.5 * block.feed_forward2(z)
    assert not torch.allclose(block(x), z, atol=1e-3)


def test_convolution_module_layers_in_order():
    torch.manual_seed(0)
    module = ConvolutionModule(8, kernel_size=3, dropout=0.0, dtype=torch.float64).eval()
    x = torch.randn(2, 6, 8, dtype=torch.float64)
    y = module.norm(x).transpose(1, 2)
    y = nn.functional.glu(module.pointwise1(y), dim=1)
    y = module.pointwise2(nn.functional.silu(module.batch_norm(module.depthwise(y))))
    torch.testing.assert_close(module(x), y.transpose(1, 2), atol=1e-12, rtol=1e-12)
    assert module.depthwise.groups == 8 and module.depthwise.kernel_size == (3,)
    assert module.pointwise1.out_channels == 16  # GLU halves it back to 8


def test_causal_convolution_module_never_reads_the_future():
    torch.manual_seed(0)
    causal = ConvolutionModule(6, kernel_size=4, dropout=0.0, causal=True, dtype=torch.float64).eval()
    centred = ConvolutionModule(6, kernel_size=5, dropout=0.0, dtype=torch.float64).eval()
    x = torch.randn(2, 9, 6, dtype=torch.float64)
    future = x.clone()
    future[:, 5:] = torch.randn(2, 4, 6, dtype=torch.float64)  # change frames 5.. only
    torch.testing.assert_close(causal(future)[:, :5], causal(x)[:, :5], atol=0, rtol=0)
    assert not torch.allclose(centred(future)[:, :5], centred(x)[:, :5]), "the centred one reads ahead (control)"
    # The same layers with K - 1 zeros on the left, written out.
    y = nn.functional.glu(causal.pointwise1(causal.norm(x).transpose(1, 2)), dim=1)  # (B, E, T)
    y = nn.functional.conv1d(nn.functional.pad(y, (3, 0)), causal.depthwise.weight, causal.depthwise.bias, groups=6)
    y = causal.pointwise2(nn.functional.silu(causal.batch_norm(y)))
    torch.testing.assert_close(causal(x), y.transpose(1, 2), atol=1e-12, rtol=1e-12)
    # Padding still never leaks: a padded clip's real frames equal the clip alone.
    keep = padding_mask(torch.tensor([9, 6]), 9)
    torch.testing.assert_close(causal(x, keep)[1, :6], causal(x[1:, :6])[0], atol=1e-12, rtol=1e-12)
    with pytest.raises(ValueError, match="odd kernel_size"):
        ConvolutionModule(6, kernel_size=4)


def test_convolution_module_and_masked_batch_norm_check_their_inputs():
    module = ConvolutionModule(8, kernel_size=3)
    with pytest.raises(ValueError, match=r"\(B, T, E=8\)"):
        module(torch.randn(2, 5, 6))
    with pytest.raises(TypeError, match="bool"):
        module(torch.randn(2, 5, 8), torch.ones(2, 5))
    with pytest.raises(ValueError, match=r"\(B, T\) = \(2, 5\)"):
        module(torch.randn(2, 5, 8), torch.ones(2, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"frame mask for x \(B, C, T\) = \(2, 8, 5\)"):
        MaskedBatchNorm1d(8)(torch.randn(2, 8, 5), torch.ones(2, 8, dtype=torch.bool))


def test_lesson_preset_convolutions_see_less_than_the_gap_between_presses():
    """Measured on the preset's modules: which input frames can change one output frame of the depthwise conv."""
    from attn_course.data.audio import DTMF_TASK

    config = ConformerConfig.dtmf()
    torch.manual_seed(0)
    encoder = ConformerEncoder(config, dtype=torch.float64).eval()
    convolution = encoder.blocks[0].convolution
    x = torch.randn(1, 61, config.n_mels, dtype=torch.float64)

    def conv_out(features):  # subsampling -> projection -> the block's convolution module
        with torch.no_grad():
            return convolution(encoder.input_projection(encoder.subsampling(features)))[0, 7]  # output frame 7

    base = conv_out(x)
    reached = []
    for t in range(16, 47):  # frame 7 reads input frames 24-38; a margin of 8 on each side
        nudged = x.clone()
        nudged[0, t] += 10 * torch.randn(config.n_mels, dtype=torch.float64)
        if not torch.allclose(conv_out(nudged), base, atol=0, rtol=0):
            reached.append(t)
    assert reached == list(range(24, 39)), reached  # 7 + 4 (K - 1) = 15 input frames
    hop, window = 160 / 8000, 256 / 8000
    assert (len(reached) - 1) * hop + window < DTMF_TASK["gap_seconds"][0]


def test_lesson_preset_edge_frames_see_no_press_of_the_lesson_task():
    """The first block frame's depthwise window (which also sees the zero padding before the clip) is
    measured on the preset's modules: the input frames that can change it must end before the task's
    margin, so a press never lies inside it (the last frame is the mirror image)."""
    from attn_course.data.audio import DTMF_TASK

    config = ConformerConfig.dtmf()
    torch.manual_seed(0)
    encoder = ConformerEncoder(config, dtype=torch.float64).eval()
    convolution = encoder.blocks[0].convolution
    x = torch.randn(1, 76, config.n_mels, dtype=torch.float64)

    def conv_out(features):  # subsampling -> projection -> the block's convolution module, block frame 0
        with torch.no_grad():
            return convolution(encoder.input_projection(encoder.subsampling(features)))[0, 0]

    base = conv_out(x)
    reached = []
    for t in range(30):
        nudged = x.clone()
        nudged[0, t] += 10 * torch.randn(config.n_mels, dtype=torch.float64)
        if not torch.allclose(conv_out(nudged), base, atol=0, rtol=0):
            reached.append(t)
    assert reached == list(range(11)), reached  # 7 + 4 (K // 2) input frames
    hop, window = 160 / 8000, 256 / 8000
    reach_seconds = reached[-1] * hop + window / 2  # centred frames: frame t covers t * hop +- window / 2
    assert reach_seconds < DTMF_TASK["margin_seconds"], reach_seconds  # 0.216 s < 0.3 s


def test_attention_uses_relative_positions_by_default():
    block = ConformerBlock(SMALL)
    assert isinstance(block.attention.attention, RelativePositionMultiHeadAttention)
    plain = ConformerBlock(dataclasses.replace(SMALL, positions="none"))
    assert type(plain.attention.attention) is MultiHeadAttention


# ---------------------------------------------------------------- encoder / classifier


def test_shapes_lengths_and_attention_maps(device):
    model = make(ConformerEncoder, device=device).eval()
    x = features(device=device)
    lengths = torch.tensor([40, 23, 7], device=device)
    encoded, out_lengths, maps = model(x, lengths, need_weights=True)
    expected_lengths = [((n - 1) // 2 - 1) // 2 for n in (40, 23, 7)]
    assert out_lengths.tolist() == expected_lengths == [9, 5, 1]
    assert encoded.shape == (3, 9, SMALL.d_model)
    assert len(maps) == SMALL.num_layers and maps[0].shape == (3, SMALL.num_heads, 9, 9)
    keep = padding_mask(out_lengths, 9)
    assert (maps[0][~keep[:, None, None, :].expand_as(maps[0])] == 0).all(), "padded keys must get zero weight"
    torch.testing.assert_close(maps[0].sum(-1), torch.ones_like(maps[0].sum(-1)))


def test_subsampling_lengths_match_the_convolutions():
    sub = ConvSubsampling(12, 2)
    for T in range(7, 30):
        out = sub(torch.randn(1, T, 12))
        assert out.shape[1] == ConvSubsampling.output_lengths(torch.tensor([T])).item(), T


@pytest.mark.parametrize("config", [SMALL, dataclasses.replace(SMALL, positions="absolute"), dataclasses.replace(SMALL, positions="none")], ids=["relative", "absolute", "none"])
def test_padding_never_changes_valid_outputs_in_eval_mode(config):
    model = make(config=config).eval()
    x = features()
    lengths = torch.tensor([40, 29, 13])
    logits = model(x, lengths)
    encoded, out_lengths = model.encoder(x, lengths)
    junk = x.clone()
    pad = ~padding_mask(lengths, 40)  # (B, T), True at padding
    junk[pad] = 1e3 * torch.randn(int(pad.sum()), SMALL.n_mels, dtype=torch.float64)
    encoded_junk, _ = model.encoder(junk, lengths)
    keep = padding_mask(out_lengths, encoded.shape[1])
    torch.testing.assert_close(encoded_junk[keep], encoded[keep], atol=1e-12, rtol=0)
    torch.testing.assert_close(model(junk, lengths), logits, atol=1e-12, rtol=0)
    # Junk injected into the padded frames *between* layers (after the input projection and
    # after every block) must not reach the real frames either.
    gen = torch.Generator().manual_seed(7)

    def inject_junk(module, inputs, output):
        pad_out = ~padding_mask(out_lengths, output.shape[1])  # (B, T')
        noise = 1e3 * torch.randn(output.shape, generator=gen, dtype=output.dtype)
        return torch.where(pad_out[:, :, None], noise, output)

    handles = [model.encoder.input_projection.register_forward_hook(inject_junk)]
    handles += [block.register_forward_hook(inject_junk) for block in model.encoder.blocks]
    try:
        encoded_hooked, _ = model.encoder(x, lengths)
        logits_hooked = model(x, lengths)
    finally:
        for handle in handles:
            handle.remove()
    assert not torch.allclose(encoded_hooked, encoded), "the hooks should have changed the padded frames"
    torch.testing.assert_close(encoded_hooked[keep], encoded[keep], atol=1e-12, rtol=0)
    torch.testing.assert_close(logits_hooked, logits, atol=1e-12, rtol=0)
    # ... and each clip alone, unpadded, gives the same logits as inside the padded batch.
    for b, n in enumerate(lengths.tolist()):
        alone = model(x[b : b + 1, :n])
        torch.testing.assert_close(alone, logits[b : b + 1], atol=1e-12, rtol=0)


def test_plain_batch_norm_lets_padding_in_during_training_and_masked_does_not():
    # Padded input frames are zeroed, so their *content* never matters; but a plain
    # BatchNorm's training statistics average over padded frames too, so *how much* padding
    # the batch carries changes every output. The masked BatchNorm counts real frames only.
    x = features(T=40)
    lengths = torch.tensor([40, 29, 13])
    longer = torch.cat([x, torch.randn(3, 20, SMALL.n_mels, dtype=torch.float64)], dim=1)  # (B, 60, F)
    keep = padding_mask(ConvSubsampling.output_lengths(lengths), 9)
    for masked in (True, False):
        model = make(config=dataclasses.replace(SMALL, dropout=0.0, masked_batch_norm=masked)).train()
        a, _ = model.encoder(x, lengths)
        b, _ = model.encoder(longer, lengths)
        changed = not torch.allclose(a[keep], b[:, :9][keep], atol=1e-12, rtol=0)
        assert changed is (not masked), f"masked_batch_norm={masked}"


def test_masked_batch_norm_equals_batch_norm_on_real_frames():
    torch.manual_seed(0)
    masked = MaskedBatchNorm1d(4, dtype=torch.float64)
    plain = nn.BatchNorm1d(4, dtype=torch.float64)
    x = torch.randn(3, 4, 7, dtype=torch.float64)
    lengths = [7, 5, 2]
    keep = padding_mask(lengths, 7)
    out = masked(x, keep)
    real = torch.cat([x[b, :, :n] for b, n in enumerate(lengths)], dim=1)[None]  # (1, C, sum of lengths)
    expected = plain(real)
    got = torch.cat([out[b, :, :n] for b, n in enumerate(lengths)], dim=1)[None]
    torch.testing.assert_close(got, expected, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(masked.running_mean, plain.running_mean, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(masked.running_var, plain.running_var, atol=1e-12, rtol=1e-12)
    # No mask, or eval mode: exactly BatchNorm1d.
    torch.testing.assert_close(masked(x), plain(x), atol=1e-12, rtol=1e-12)
    masked.eval(), plain.eval()
    torch.testing.assert_close(masked(x, keep), plain(x), atol=1e-12, rtol=1e-12)


def test_masked_batch_norm_without_running_statistics_masks_in_every_mode():
    # With track_running_stats=False, nn.BatchNorm1d normalises with the batch's statistics in
    # evaluation mode too, so the mask must apply there as well (it once fell back to the plain
    # BatchNorm: real frames then moved by about 2 when padding was added).
    torch.manual_seed(0)
    x = torch.randn(3, 4, 7, dtype=torch.float64)  # (B, C, T)
    lengths = [7, 5, 2]
    keep = padding_mask(lengths, 7)  # (B, T)
    x_long = torch.cat([x, 5 + torch.randn(3, 4, 6, dtype=torch.float64)], dim=2)  # (B, C, 13): more padding
    keep_long = padding_mask(lengths, 13)  # (B, 13)
    real = torch.cat([x[b, :, :n] for b, n in enumerate(lengths)], dim=1)[None]  # (1, C, sum of lengths)
    for training in (True, False):
        masked = MaskedBatchNorm1d(4, track_running_stats=False, dtype=torch.float64).train(training)
        plain = nn.BatchNorm1d(4, track_running_stats=False, dtype=torch.float64).train(training)
        out, out_long = masked(x, keep), masked(x_long, keep_long)[:, :, :7]  # (B, C, T) each
        torch.testing.assert_close(out.transpose(1, 2)[keep], out_long.transpose(1, 2)[keep], atol=1e-12, rtol=0)
        got = torch.cat([out[b, :, :n] for b, n in enumerate(lengths)], dim=1)[None]
        torch.testing.assert_close(got, plain(real), atol=1e-12, rtol=1e-12)
        assert masked.running_mean is None and masked.num_batches_tracked is None
    # The plain module does let the padding in (so the comparison above can fail).
    plain = nn.BatchNorm1d(4, track_running_stats=False, dtype=torch.float64).eval()
    assert (plain(x) - plain(x_long)[:, :, :7]).transpose(1, 2)[keep].abs().max() > 0.1


def test_every_parameter_gets_a_gradient_and_nothing_is_nan():
    model = make()
    model.train()
    logits = model(features(), torch.tensor([40, 30, 20]))
    assert torch.isfinite(logits).all()
    nn.functional.cross_entropy(logits, torch.tensor([0, 1, 4])).backward()
    for name, param in model.named_parameters():
        assert param.grad is not None and torch.isfinite(param.grad).all(), name
        assert param.grad.abs().sum() > 0, name


def test_a_few_steps_reduce_the_loss_on_a_tiny_batch():
    torch.manual_seed(0)
    model = ConformerClassifier(dataclasses.replace(SMALL, dropout=0.0))
    x = torch.randn(10, 24, SMALL.n_mels)
    labels = torch.arange(10) % SMALL.num_classes
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(12):
        loss = nn.functional.cross_entropy(model(x), labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses


# ---------------------------------------------------------------- config


def _parameter_shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


CHANGED = {
    "n_mels": 20,
    "num_classes": 7,
    "d_model": 24,
    "num_layers": 3,
    "num_heads": 4,
    "ff_expansion": 3,
    "conv_kernel_size": 7,
    "subsampling_channels": 6,
    "dropout": 0.3,
    "positions": "absolute",
    "use_convolution": False,
    "masked_batch_norm": False,
}


def test_the_changed_values_cover_every_field():
    assert set(CHANGED) == {f.name for f in dataclasses.fields(ConformerConfig)}, "a new field needs a case in CHANGED"


@pytest.mark.parametrize("field", sorted(CHANGED))
def test_every_config_field_reaches_its_module(field):
    changed = dataclasses.replace(SMALL, **{field: CHANGED[field]})
    a, b = make(config=SMALL), make(config=changed)
    x_a, x_b = features(F=SMALL.n_mels), features(F=changed.n_mels)
    assert b(x_b).shape == (3, changed.num_classes)
    if field == "dropout":
        assert _parameter_shapes(a) == _parameter_shapes(b)
        rates = {m.p for m in b.modules() if isinstance(m, nn.Dropout)} | {
            m.dropout for m in b.modules() if isinstance(m, MultiHeadAttention)
        }
        assert rates == {0.3}
        return
    if field == "num_heads":
        assert b.encoder.blocks[0].attention.attention.num_heads == 4
        assert b.encoder(x_b, need_weights=True)[2][0].shape[1] == 4
        return
    if field == "positions":
        # Absolute: plain attention, and the same frames shifted in time give different outputs.
        assert type(b.encoder.blocks[0].attention.attention) is MultiHeadAttention
        assert _parameter_shapes(a) != _parameter_shapes(b)  # no u, v, W_r
        shift_error = {positions: _time_shift_error(changed, positions) for positions in ("none", "absolute")}
        # Without positions (and without the convolution) every layer is per-frame or permutation-
        # equivariant: shifted frames give shifted outputs, to rounding. The absolute table breaks it.
        # Measured: 6.7e-16 without positions, 1.8 with the absolute table.
        assert shift_error["none"] < 1e-12 and shift_error["absolute"] > 1e-3, shift_error
        return
    if field == "masked_batch_norm":
        kinds = {type(m) for m in b.modules() if isinstance(m, nn.BatchNorm1d)}
        assert kinds == {nn.BatchNorm1d}
        return
    assert _parameter_shapes(a) != _parameter_shapes(b), f"{field} did not change the model"


def _time_shift_error(config: ConformerConfig, positions: str) -> float:
    """Shift the frames the blocks see by one step (circularly); how far do the outputs move from shifted?

    A forward hook replaces the subsampler's output by chosen frames, so the shift is exact (shifting
    the audio would not be: each subsampled frame reads 7 input frames).
    """
    model = make(ConformerEncoder, config=dataclasses.replace(config, positions=positions, use_convolution=False))
    model.eval()
    clip = features(B=1, F=config.n_mels)
    steps = model(clip)[0].shape[1]  # T'
    frames = torch.randn(1, steps, config.d_model, generator=torch.Generator().manual_seed(3), dtype=torch.float64)

    def encode(h: torch.Tensor) -> torch.Tensor:
        handle = model.input_projection.register_forward_hook(lambda module, inputs, output: h)
        try:
            return model(clip)[0]  # (1, T', E)
        finally:
            handle.remove()

    return (encode(frames.roll(1, dims=1)) - encode(frames).roll(1, dims=1)).abs().max().item()


def test_config_validation_and_preset():
    with pytest.raises(ValueError, match="odd"):
        ConformerConfig(conv_kernel_size=4)
    with pytest.raises(ValueError, match="must divide d_model"):
        ConformerConfig(d_model=30, num_heads=4)
    with pytest.raises(ValueError, match="positions"):
        ConformerConfig(positions="rotary")
    with pytest.raises(dataclasses.FrozenInstanceError):
        SMALL.d_model = 8  # type: ignore[misc]
    preset = ConformerConfig.dtmf()
    assert preset.num_classes == 12 and preset.positions == "relative" and preset.use_convolution


def test_encoder_errors_name_the_shapes():
    model = make(ConformerEncoder)
    with pytest.raises(ValueError, match=r"\(B, T, F=12\)"):
        model(torch.randn(2, 30, 8, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"lengths must be in \[1, T=30\]"):
        model(torch.randn(2, 30, 12, dtype=torch.float64), torch.tensor([31, 4]))
    with pytest.raises(ValueError, match="at least 7 frames"):
        model(torch.randn(2, 30, 12, dtype=torch.float64), torch.tensor([30, 4]))


def test_block_checks_its_inputs():
    block = ConformerBlock(SMALL)
    with pytest.raises(ValueError, match=r"\(B, T, E=16\)"):
        block(torch.randn(2, 5, 8))
    with pytest.raises(TypeError, match="bool"):
        block(torch.randn(2, 5, 16), torch.ones(2, 5))
    with pytest.raises(ValueError, match=r"\(B, T\) = \(2, 5\)"):
        block(torch.randn(2, 5, 16), torch.ones(2, 4, dtype=torch.bool))
