"""DTMF audio generated in code: tones, clips, mel filterbank, log-mel spectrogram, the dataset."""

from __future__ import annotations

import math

import pytest
import torch

from attn_course.data.audio import (
    DTMF_KEYS,
    DTMF_TASK,
    SAMPLE_RATE,
    dtmf_tone,
    hz_to_mel,
    key_frequencies,
    log_mel_spectrogram,
    make_dtmf_dataset,
    make_dtmf_split,
    mel_filterbank,
    mel_to_hz,
    synthesize_clip,
)


def test_keypad_frequencies():
    assert key_frequencies("5") == (770.0, 1336.0)
    assert key_frequencies("*") == (941.0, 1209.0)
    assert key_frequencies("D") == (941.0, 1633.0)
    assert len(DTMF_KEYS) == 12 and len({key_frequencies(k) for k in DTMF_KEYS}) == 12
    with pytest.raises(ValueError, match="not a DTMF key"):
        key_frequencies("x")


def test_tone_has_exactly_its_two_frequencies():
    tone = dtmf_tone("9", SAMPLE_RATE, dtype=torch.float64)  # one second: FFT bins are 1 Hz apart
    magnitude = torch.fft.rfft(tone).abs()
    assert sorted(magnitude.topk(2).indices.tolist()) == [852, 1477]
    assert magnitude[852].item() == pytest.approx(SAMPLE_RATE / 2, rel=1e-6)


def _dominant_key(segment: torch.Tensor) -> str:
    """The key whose two frequencies carry the most energy in ``segment`` (a Goertzel-style probe)."""
    t = torch.arange(segment.shape[0], dtype=torch.float64) / SAMPLE_RATE

    def energy(f):
        return (segment * torch.exp(-2j * math.pi * f * t)).sum().abs().item()

    return max(DTMF_KEYS, key=lambda k: sum(energy(f) for f in key_frequencies(k)))


def test_clip_presses_the_keys_in_order_and_is_deterministic():
    options = {"snr_db": (30.0, 30.0), "tone_seconds": (0.1, 0.1), "gap_seconds": (0.1, 0.1)}
    clip = synthesize_clip("3#7", generator=torch.Generator().manual_seed(0), dtype=torch.float64, **options)
    assert clip.shape == (SAMPLE_RATE,)
    loud = (clip.unfold(0, 80, 80).square().mean(-1) > 0.5 * clip.square().max().item() / 4)  # (100,) 10 ms windows
    starts = [i for i in range(1, 100) if loud[i] and not loud[i - 1]] or [0]
    if loud[0]:
        starts = [0] + starts
    assert len(starts) == 3
    keys = "".join(_dominant_key(clip[80 * s + 80 : 80 * s + 720]) for s in starts)
    assert keys == "3#7"
    again = synthesize_clip("3#7", generator=torch.Generator().manual_seed(0), dtype=torch.float64, **options)
    assert torch.equal(clip, again)
    other = synthesize_clip("3#7", generator=torch.Generator().manual_seed(1), dtype=torch.float64, **options)
    assert not torch.equal(clip, other)


def test_clip_snr_is_what_was_asked():
    gen = torch.Generator().manual_seed(0)
    noise_only = synthesize_clip("1", generator=gen, snr_db=(10.0, 10.0), level_db=(0.0, 0.0), tone_seconds=(0.001, 0.001))
    # Tone power is level^2 = 1 at 0 dB, so the noise power is 10^(-10/10) = 0.1.
    assert noise_only.square().mean().item() == pytest.approx(0.1, rel=0.05)
    with pytest.raises(ValueError, match="longer clip_seconds"):
        synthesize_clip("1234567890", generator=gen, tone_seconds=(0.1, 0.1))


def test_mel_scale_round_trip():
    assert hz_to_mel(1000.0).item() == pytest.approx(1000.0, abs=0.1)  # HTK: 1000 Hz is ~1000 mel
    hz = torch.tensor([0.0, 440.0, 3999.0], dtype=torch.float64)
    torch.testing.assert_close(mel_to_hz(hz_to_mel(hz)), hz)


def test_mel_filterbank_triangles():
    filters = mel_filterbank(n_fft=512, n_mels=20, dtype=torch.float64)  # (257, 20)
    assert filters.shape == (257, 20) and (filters >= 0).all() and filters.max() <= 1
    bin_hz = torch.linspace(0, SAMPLE_RATE / 2, 257, dtype=torch.float64)
    edges = mel_to_hz(torch.linspace(0, hz_to_mel(SAMPLE_RATE / 2).item(), 22, dtype=torch.float64))
    peaks = filters.argmax(0)
    # Each filter peaks at one of the two FFT bins around its centre frequency, in increasing order.
    bin_width = bin_hz[1] - bin_hz[0]
    assert ((bin_hz[peaks] - edges[1:-1]).abs() < bin_width).all() and (peaks.diff() > 0).all()
    # ... and is zero at and beyond its edges.
    for m in range(20):
        outside = (bin_hz <= edges[m]) | (bin_hz >= edges[m + 2])
        assert (filters[outside, m] == 0).all()
    # Between the first and the last centre, neighbouring triangles sum to exactly 1.
    inside = (bin_hz >= edges[1]) & (bin_hz <= edges[-2])
    torch.testing.assert_close(filters[inside].sum(1), torch.ones(int(inside.sum()), dtype=torch.float64))
    with pytest.raises(ValueError, match="f_max"):
        mel_filterbank(n_fft=256, n_mels=10, f_max=5000.0)


def test_log_mel_matches_a_direct_dft_of_one_frame():
    gen = torch.Generator().manual_seed(0)
    wave = torch.randn(2, 1600, generator=gen, dtype=torch.float64)
    n_fft, hop = 256, 80
    out = log_mel_spectrogram(wave, n_fft=n_fft, hop_length=hop, n_mels=16)
    assert out.shape == (2, 1600 // hop + 1, 16) and out.dtype == torch.float64
    t = 7  # a frame away from the edges: samples t*hop - n_fft/2 .. + n_fft
    frame = wave[1, t * hop - n_fft // 2 : t * hop + n_fft // 2]
    n = torch.arange(n_fft, dtype=torch.float64)
    window = 0.5 - 0.5 * torch.cos(2 * math.pi * n / n_fft)  # periodic Hann
    k = torch.arange(n_fft // 2 + 1, dtype=torch.float64)
    dft = (frame * window * torch.exp(-2j * math.pi * k[:, None] * n / n_fft)).sum(-1)  # (n_freqs,)
    expected = (dft.abs().square() @ mel_filterbank(n_fft=n_fft, n_mels=16, dtype=torch.float64)).log()
    torch.testing.assert_close(out[1, t], expected, atol=1e-9, rtol=1e-9)
    torch.testing.assert_close(log_mel_spectrogram(wave[0], n_mels=16), out[0])  # unbatched works too


def test_log_mel_of_a_tone_lights_its_band():
    filters = mel_filterbank(n_fft=256, n_mels=40, dtype=torch.float64)
    tone = dtmf_tone("1", 4000, dtype=torch.float64)  # 697 + 1209 Hz
    mel = log_mel_spectrogram(tone).mean(0)  # (40,)
    bin_hz = torch.linspace(0, SAMPLE_RATE / 2, 129, dtype=torch.float64)
    for f in key_frequencies("1"):
        band = int(filters[(bin_hz - f).abs().argmin()].argmax())
        assert mel[band] > mel.median() + 5  # far above the rest (natural log of power)


def test_dataset_labels_are_the_last_key_and_deterministic():
    data = make_dtmf_dataset(24, seed=3)
    assert data.features.shape == (24, 51, 24) and data.labels.shape == (24,)
    assert all(2 <= len(s) <= 4 for s in data.sequences)
    assert [DTMF_KEYS[i] for i in data.labels.tolist()] == [s[-1] for s in data.sequences]
    again = make_dtmf_dataset(24, seed=3)
    assert torch.equal(again.features, data.features) and again.sequences == data.sequences
    assert make_dtmf_dataset(24, seed=4).sequences != data.sequences
    one, waves = make_dtmf_dataset(2, seed=0, presses=(1, 1), return_waveforms=True)
    assert waves.shape == (2, SAMPLE_RATE) and all(len(s) == 1 for s in one.sequences)
    assert data.lengths.tolist() == [51] * 24 and all(len(t) == len(s) for t, s in zip(data.times, data.sequences))


def test_clips_of_different_lengths_are_padded_with_zero_frames():
    data, waves = make_dtmf_dataset(12, seed=1, clip_seconds=(0.8, 1.2), presses=(2, 2), gap_seconds=(0.3, 0.4),
                                    return_waveforms=True)
    assert data.features.shape == (12, 61, 24) and waves.shape == (12, int(1.2 * SAMPLE_RATE))
    assert len(set(data.lengths.tolist())) > 1 and data.lengths.min() >= 0.8 * SAMPLE_RATE // 160 + 1
    for n, length in enumerate(data.lengths.tolist()):
        samples = int(waves[n].nonzero().max()) + 1  # the clip's noise runs to its last sample
        assert length == samples // 160 + 1, "a clip gets as many frames as it would alone"
        assert (data.features[n, length:] == 0).all() and (data.features[n, :length] != 0).all()
        # Frames whose window lies inside the clip equal the clip's own spectrogram.
        alone = log_mel_spectrogram(waves[n, :samples], n_mels=24, hop_length=160, n_fft=256)  # (length, 24)
        inside = (samples - 128) // 160 + 1  # frames t with t * 160 + 128 <= samples
        torch.testing.assert_close(data.features[n, 1:inside], alone[1:inside])


def test_press_times_are_where_the_tones_are():
    data, waves = make_dtmf_dataset(6, seed=2, snr_db=(30.0, 30.0), return_waveforms=True, **{
        k: v for k, v in DTMF_TASK.items() if k != "snr_db"})
    for keys, times, wave in zip(data.sequences, data.times, waves.double()):
        assert len(times) == len(keys) == 2
        (start1, end1), (start2, end2) = times
        assert 0 <= start1 < end1 < start2 < end2 <= 1.2
        assert 0.06 <= end1 - start1 <= 0.12 + 1e-3 and 0.32 <= start2 - end1 <= 0.45 + 1e-3
        found = "".join(_dominant_key(wave[int(a * SAMPLE_RATE) : int(b * SAMPLE_RATE)]) for a, b in times)
        assert found == keys


def test_margin_keeps_every_press_away_from_both_clip_ends():
    options = {"tone_seconds": (0.06, 0.12), "gap_seconds": (0.32, 0.45), "snr_db": (30.0, 30.0)}
    data, waves = make_dtmf_dataset(40, seed=5, presses=(2, 2), clip_seconds=(1.3, 1.5), margin_seconds=0.3,
                                    return_waveforms=True, **options)
    seconds = data.lengths.sub(1).mul(160).double() / SAMPLE_RATE  # (N,) lower bound on each clip's duration
    starts = [times[0][0] for times in data.times]
    ends = [times[-1][1] for times in data.times]
    assert min(starts) >= 0.3 and all(end <= s - 0.3 + 160 / SAMPLE_RATE for end, s in zip(ends, seconds.tolist()))
    # Without the margin the same settings put presses nearer the ends (so the check above can fail).
    plain = make_dtmf_dataset(40, seed=5, presses=(2, 2), clip_seconds=(1.3, 1.5), **options)
    assert min(times[0][0] for times in plain.times) < 0.3
    # The margin is noise only: no tone there.
    for wave, times in zip(waves.double(), data.times):
        real = wave[: int(round(times[-1][1] * SAMPLE_RATE)) + int(0.3 * SAMPLE_RATE)]  # up to the clip's end
        tone = wave[int(times[0][0] * SAMPLE_RATE) : int(times[0][1] * SAMPLE_RATE)].square().mean()
        for edge in (real[: int(0.3 * SAMPLE_RATE)], real[-int(0.3 * SAMPLE_RATE) :]):
            assert edge.square().mean() < 0.01 * tone  # 30 dB SNR: noise only
    with pytest.raises(ValueError, match="margin"):
        synthesize_clip("12", generator=torch.Generator().manual_seed(0), clip_seconds=1.0, margin_seconds=0.3, **options)
    with pytest.raises(ValueError, match="margin_seconds must be >= 0"):
        synthesize_clip("1", generator=torch.Generator().manual_seed(0), margin_seconds=-0.1)


def test_lesson_task_keeps_presses_farther_apart_than_its_convolutions_see():
    data = make_dtmf_dataset(200, seed=3, **DTMF_TASK)
    gaps = [second[0] - first[1] for first, second in data.times]
    assert min(gaps) >= 0.32 and max(gaps) <= 0.45 + 1e-3
    assert data.features.shape[1] == 76 and 66 <= data.lengths.min() and data.lengths.max() <= 76
    # Every press at least margin_seconds from both ends of its clip (lengths bound the clip's duration).
    seconds = data.lengths.sub(1).mul(160).double() / SAMPLE_RATE  # (N,) each clip's real frames end here
    assert DTMF_TASK["margin_seconds"] == 0.3 and min(times[0][0] for times in data.times) >= 0.3
    assert all(times[-1][1] <= s - 0.3 + 160 / SAMPLE_RATE for times, s in zip(data.times, seconds.tolist()))
    assert all(len(keys) == 2 for keys in data.sequences)
    with pytest.raises(ValueError, match="clip_seconds"):
        make_dtmf_dataset(2, clip_seconds=(1.2, 0.8))


def test_split_is_standardised_with_training_statistics_over_real_frames():
    split = make_dtmf_split(num_train=40, num_val=10, num_test=20, seed=0, **DTMF_TASK)
    real = torch.arange(76)[None, :] < split.train.lengths[:, None]  # (N, T)
    assert abs(split.train.features[real].mean().item()) < 1e-4
    assert abs(split.train.features[real].std().item() - 1) < 1e-4
    for part in (split.train, split.val, split.test):
        keep = torch.arange(76)[None, :] < part.lengths[:, None]
        assert (part.features[~keep] == 0).all()
    assert len({split.train.sequences[:10], split.val.sequences, split.test.sequences[:10]}) == 3
    assert split.test.features.shape == (20, 76, 24) and split.val.features.shape == (10, 76, 24)
    fixed = make_dtmf_split(num_train=40, num_val=5, num_test=20, seed=0)
    assert abs(fixed.train.features.mean().item()) < 1e-4 and fixed.test.features.shape == (20, 51, 24)


def test_spectrogram_options_reach_the_features():
    data = make_dtmf_dataset(3, seed=0, n_mels=24, hop_length=160, n_fft=512, f_min=500.0, f_max=2000.0)
    assert data.features.shape == (3, SAMPLE_RATE // 160 + 1, 24)
    _, waves = make_dtmf_dataset(3, seed=0, return_waveforms=True)
    expected = log_mel_spectrogram(waves, n_mels=24, hop_length=160, n_fft=512, f_min=500.0, f_max=2000.0)
    torch.testing.assert_close(data.features, expected)
