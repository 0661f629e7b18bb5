"""Audio generated in code: telephone-keypad (DTMF) tones in noise, and log-mel spectrograms.

A telephone key sounds two sines at once: one "row" frequency and one "column" frequency
(ITU-T Q.23)::

               1209 Hz  1336 Hz  1477 Hz  1633 Hz
      697 Hz      1        2        3        A
      770 Hz      4        5        6        B
      852 Hz      7        8        9        C
      941 Hz      *        0        #        D

:func:`synthesize_clip` renders a sequence of key presses with random tone and gap durations,
a random start, a random level and white noise at a random signal-to-noise ratio, all
drawn from a ``torch.Generator`` (so a seed fixes everything). :func:`log_mel_spectrogram`
turns waveforms into log-mel frames with ``torch.stft`` and a mel filterbank built here
(:func:`mel_filterbank`, HTK's mel scale) -- no torchaudio, no download.

The "last key" task (:func:`make_dtmf_dataset`): each clip holds a few presses of the 12 keys
``1-9 * 0 #``; the label is the key pressed **last**. Which key is sounding at a given moment
shows in a single frame; which one came last is a question of order. Lesson 10 uses
:data:`DTMF_TASK`: two presses at least 0.32 s apart in clips of 1.3-1.5 s, padded to 1.5 s, so
that a model has to relate frames farther apart than its convolutions see, with every press at
least 0.3 s from both ends of its clip, so that the zeros past the ends tell nothing about order.

Taught in lesson 10 (Conformer).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from .._checks import check_positive_int, check_tensor, shape_str

__all__ = [
    "SAMPLE_RATE",
    "DTMF_KEYS",
    "ROW_FREQUENCIES",
    "COLUMN_FREQUENCIES",
    "key_frequencies",
    "dtmf_tone",
    "synthesize_clip",
    "hz_to_mel",
    "mel_to_hz",
    "mel_filterbank",
    "log_mel_spectrogram",
    "DTMFDataset",
    "DTMF_TASK",
    "make_dtmf_dataset",
    "DTMFSplit",
    "make_dtmf_split",
]

SAMPLE_RATE = 8000  # Hz: telephone bandwidth, comfortably above twice the highest tone (1633 Hz)
ROW_FREQUENCIES: tuple[float, ...] = (697.0, 770.0, 852.0, 941.0)
COLUMN_FREQUENCIES: tuple[float, ...] = (1209.0, 1336.0, 1477.0, 1633.0)
_KEYPAD = ("123A", "456B", "789C", "*0#D")
#: The 12 keys of a telephone, in class-index order.
DTMF_KEYS = "123456789*0#"


def key_frequencies(key: str) -> tuple[float, float]:
    """The (row, column) frequencies in Hz of a keypad key, e.g. ``'5' -> (770.0, 1336.0)``."""
    for row, keys in enumerate(_KEYPAD):
        if isinstance(key, str) and len(key) == 1 and key in keys:
            return ROW_FREQUENCIES[row], COLUMN_FREQUENCIES[keys.index(key)]
    raise ValueError(f"{key!r} is not a DTMF key; expected one of {''.join(_KEYPAD)!r}")


def dtmf_tone(
    key: str, num_samples: int, *, sample_rate: int = SAMPLE_RATE, amplitude: float = 1.0, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """``num_samples`` samples of ``key``'s two sines, each of peak ``amplitude``: ``(num_samples,)``."""
    low, high = key_frequencies(key)
    t = torch.arange(num_samples, dtype=torch.float64) / sample_rate  # (N,) seconds
    tone = amplitude * (torch.sin(2 * math.pi * low * t) + torch.sin(2 * math.pi * high * t))  # (N,)
    return tone.to(dtype)


def synthesize_clip(
    keys: str,
    *,
    generator: torch.Generator,
    sample_rate: int = SAMPLE_RATE,
    clip_seconds: float = 1.0,
    tone_seconds: tuple[float, float] = (0.05, 0.12),
    gap_seconds: tuple[float, float] = (0.04, 0.12),
    level_db: tuple[float, float] = (-20.0, 0.0),
    snr_db: tuple[float, float] = (0.0, 20.0),
    margin_seconds: float = 0.0,
    dtype: torch.dtype = torch.float32,
    return_times: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, tuple[tuple[float, float], ...]]:
    """One noisy clip ``(clip_seconds * sample_rate,)`` in which ``keys`` are pressed in order.

    Every duration, the start time, the level and the SNR are drawn uniformly from their
    ranges with ``generator``. Each tone's level also varies by up to +-3 dB. The SNR
    compares the power of the tones (while sounding) to the power of the white noise.
    The presses start at least ``margin_seconds`` after the clip starts and end at least
    ``margin_seconds`` before it ends (noise only there); the first press starts uniformly
    in the slack that leaves. With ``return_times`` also returns each press's ``(start, end)``
    in seconds.
    """
    if not keys:
        raise ValueError("keys must hold at least one key")
    if not margin_seconds >= 0:
        raise ValueError(f"margin_seconds must be >= 0, got {margin_seconds}")
    num_samples = int(round(clip_seconds * sample_rate))
    margin = int(math.ceil(margin_seconds * sample_rate))

    def uniform(low: float, high: float) -> float:
        return low + (high - low) * torch.rand((), generator=generator, dtype=torch.float64).item()

    tones = [int(uniform(*tone_seconds) * sample_rate) for _ in keys]
    gaps = [int(uniform(*gap_seconds) * sample_rate) for _ in keys[1:]]
    busy = sum(tones) + sum(gaps)
    if busy + 2 * margin > num_samples:
        raise ValueError(
            f"{len(keys)} presses need up to {busy} samples, plus {margin} of margin at each end, but the clip "
            f"has {num_samples}: use a longer clip_seconds or shorter tone_seconds / gap_seconds / margin_seconds"
        )
    start = margin + int(uniform(0, num_samples - busy - 2 * margin))
    level = 10 ** (uniform(*level_db) / 20)  # peak amplitude of each sine
    clip = torch.zeros(num_samples, dtype=torch.float64)
    position = start
    times = []
    for index, (key, length) in enumerate(zip(keys, tones)):
        amplitude = level * 10 ** (uniform(-3.0, 3.0) / 20)
        clip[position : position + length] = dtmf_tone(key, length, sample_rate=sample_rate, amplitude=amplitude, dtype=torch.float64)
        times.append((position / sample_rate, (position + length) / sample_rate))
        position += length + (gaps[index] if index < len(gaps) else 0)
    tone_power = level**2  # two sines of peak `level`: 2 * level^2 / 2
    noise_std = math.sqrt(tone_power / 10 ** (uniform(*snr_db) / 10))
    noise = torch.randn(num_samples, generator=generator, dtype=torch.float64) * noise_std
    clip = (clip + noise).to(dtype)
    return (clip, tuple(times)) if return_times else clip


def hz_to_mel(hz: torch.Tensor | float) -> torch.Tensor:
    """HTK's mel scale: ``2595 * log10(1 + hz / 700)``."""
    return 2595.0 * torch.log10(1.0 + torch.as_tensor(hz, dtype=torch.float64) / 700.0)


def mel_to_hz(mel: torch.Tensor | float) -> torch.Tensor:
    """Inverse of :func:`hz_to_mel`: ``700 * (10^(mel / 2595) - 1)``."""
    return 700.0 * (10.0 ** (torch.as_tensor(mel, dtype=torch.float64) / 2595.0) - 1.0)


def mel_filterbank(
    *,
    n_fft: int,
    n_mels: int,
    sample_rate: int = SAMPLE_RATE,
    f_min: float = 0.0,
    f_max: float | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Triangular mel filters ``(n_fft // 2 + 1, n_mels)``: multiply a power spectrum by it.

    ``n_mels + 2`` points equally spaced on the mel scale between ``f_min`` and ``f_max``
    (default ``sample_rate / 2``) give each filter its left edge, peak and right edge; the
    filter rises linearly from 0 at its left edge to 1 at its peak and falls back to 0 at
    its right edge. Between two neighbouring peaks the two filters sum to 1.
    """
    f_max = sample_rate / 2 if f_max is None else f_max
    if n_fft < 2 or n_mels < 1:
        raise ValueError(f"need n_fft >= 2 and n_mels >= 1, got n_fft={n_fft}, n_mels={n_mels}")
    if not 0 <= f_min < f_max <= sample_rate / 2:
        raise ValueError(f"need 0 <= f_min < f_max <= sample_rate / 2 = {sample_rate / 2}, got {f_min}, {f_max}")
    bin_hz = torch.linspace(0, sample_rate / 2, n_fft // 2 + 1, dtype=torch.float64)  # (n_freqs,)
    edges = mel_to_hz(torch.linspace(float(hz_to_mel(f_min)), float(hz_to_mel(f_max)), n_mels + 2, dtype=torch.float64))
    left, centre, right = edges[:-2], edges[1:-1], edges[2:]  # (n_mels,) each
    rising = (bin_hz[:, None] - left) / (centre - left)  # (n_freqs, n_mels)
    falling = (right - bin_hz[:, None]) / (right - centre)  # (n_freqs, n_mels)
    filters = torch.minimum(rising, falling).clamp(min=0.0)  # (n_freqs, n_mels)
    return filters.to(dtype=dtype, device=device)


def log_mel_spectrogram(
    waveform: torch.Tensor,
    *,
    sample_rate: int = SAMPLE_RATE,
    n_fft: int = 256,
    hop_length: int = 80,
    n_mels: int = 40,
    f_min: float = 0.0,
    f_max: float | None = None,
    floor: float = 1e-10,
) -> torch.Tensor:
    """Log-mel frames of ``waveform`` ``(..., N)`` -> ``(..., T, n_mels)`` with ``T = N // hop_length + 1``.

    Hann window of ``n_fft`` samples, centred frames every ``hop_length`` samples (at 8 kHz
    the defaults are 32 ms windows every 10 ms), power spectrum, mel filterbank, natural log
    (clamped at ``floor``).
    """
    waveform = check_tensor("waveform", waveform, min_dim=1)
    if waveform.shape[-1] < n_fft:
        raise ValueError(f"waveform must have at least n_fft={n_fft} samples, got shape {shape_str(waveform.shape)}")
    batch = waveform.shape[:-1]
    flat = waveform.reshape(-1, waveform.shape[-1])  # (B', N)
    window = torch.hann_window(n_fft, dtype=waveform.dtype, device=waveform.device)  # (n_fft,)
    spectrum = torch.stft(flat, n_fft, hop_length=hop_length, window=window, center=True, return_complex=True)  # (B', n_freqs, T)
    power = spectrum.real.square() + spectrum.imag.square()  # (B', n_freqs, T)
    filters = mel_filterbank(
        n_fft=n_fft, n_mels=n_mels, sample_rate=sample_rate, f_min=f_min, f_max=f_max, dtype=waveform.dtype, device=waveform.device
    )  # (n_freqs, n_mels)
    mel = torch.matmul(power.transpose(1, 2), filters)  # (B', T, n_mels)
    return mel.clamp(min=floor).log().reshape(*batch, mel.shape[1], n_mels)  # (..., T, n_mels)


@dataclass(frozen=True)
class DTMFDataset:
    """Clips of the "last key" task.

    Attributes:
        features: log-mel frames ``(N, T, n_mels)``; frames past a clip's length are zero.
        labels: class index ``(N,)`` (int64) of the last key, in ``DTMF_KEYS`` order.
        sequences: the keys pressed in each clip, e.g. ``"4#1"`` (label ``'1'``).
        lengths: real frames per clip ``(N,)`` (int64); all ``T`` when every clip has the same duration.
        times: each press's ``(start, end)`` in seconds, per clip.
    """

    features: torch.Tensor
    labels: torch.Tensor
    sequences: tuple[str, ...]
    lengths: torch.Tensor
    times: tuple[tuple[tuple[float, float], ...], ...]


#: Keyword arguments of :func:`make_dtmf_dataset` / :func:`make_dtmf_split` for lesson 10's task:
#: two presses of 60-120 ms, 0.32-0.45 s apart (more than the 0.31 s of audio that lesson 10's
#: convolutions see at once), clips of 1.3-1.5 s padded to 1.5 s (76 frames), every press at least
#: 0.3 s from both ends of its clip (the first and last frames' convolution windows, which also see
#: the zeros past the ends, reach about 0.22 s from the start and up to 0.30 s from the end; lesson 10
#: counts the few presses that the spectrogram's edge frames reach), SNR 10-30 dB.
DTMF_TASK: dict[str, object] = {
    "presses": (2, 2),
    "clip_seconds": (1.3, 1.5),
    "tone_seconds": (0.06, 0.12),
    "gap_seconds": (0.32, 0.45),
    "margin_seconds": 0.3,
    "snr_db": (10.0, 30.0),
}


def make_dtmf_dataset(
    num_clips: int,
    *,
    seed: int = 0,
    presses: tuple[int, int] = (2, 4),
    clip_seconds: float | tuple[float, float] = 1.0,
    n_mels: int = 24,
    n_fft: int = 256,
    hop_length: int = 160,
    f_min: float = 0.0,
    f_max: float | None = None,
    return_waveforms: bool = False,
    **clip_options: object,
) -> DTMFDataset | tuple[DTMFDataset, torch.Tensor]:
    """``num_clips`` clips of ``presses[0]..presses[1]`` random keys; label = the key pressed last.

    The defaults give ``(N, 51, 24)`` features: 24 mel bands every 20 ms over one second.
    ``clip_seconds`` = ``(low, high)`` draws each clip's duration uniformly: the clips are then
    padded with silence to ``high`` seconds, ``lengths`` says how many frames are real
    (``samples // hop_length + 1``, as for the clip alone) and the padded frames are zero.
    Deterministic for a given ``seed``. ``n_mels``, ``n_fft``, ``hop_length``, ``f_min`` and
    ``f_max`` go to :func:`log_mel_spectrogram`; ``clip_options`` to :func:`synthesize_clip`
    (durations, level, SNR). With ``return_waveforms`` also returns the clips ``(N, samples)``.
    """
    check_positive_int("num_clips", num_clips)
    if not 1 <= presses[0] <= presses[1]:
        raise ValueError(f"presses must be (low, high) with 1 <= low <= high, got {presses}")
    low, high = (clip_seconds, clip_seconds) if isinstance(clip_seconds, (int, float)) else clip_seconds
    if not 0 < low <= high:
        raise ValueError(f"clip_seconds must be a positive float or (low, high) with 0 < low <= high, got {clip_seconds!r}")
    sample_rate = int(clip_options.get("sample_rate", SAMPLE_RATE))  # type: ignore[call-overload]
    total = int(round(high * sample_rate))
    generator = torch.Generator().manual_seed(seed)
    waveforms = torch.zeros(num_clips, total)  # (N, samples), silence after each clip's end
    labels, sequences, samples, times = [], [], [], []
    for n in range(num_clips):
        count = int(torch.randint(presses[0], presses[1] + 1, (), generator=generator))
        indices = torch.randint(len(DTMF_KEYS), (count,), generator=generator).tolist()
        keys = "".join(DTMF_KEYS[i] for i in indices)
        seconds = low if low == high else low + (high - low) * torch.rand((), generator=generator, dtype=torch.float64).item()
        clip, pressed = synthesize_clip(keys, generator=generator, clip_seconds=seconds, return_times=True, **clip_options)  # type: ignore[arg-type]
        waveforms[n, : clip.shape[0]] = clip
        labels.append(indices[-1])
        sequences.append(keys)
        samples.append(clip.shape[0])
        times.append(pressed)
    features = log_mel_spectrogram(
        waveforms, sample_rate=sample_rate, n_mels=n_mels, n_fft=n_fft, hop_length=hop_length, f_min=f_min, f_max=f_max
    )  # (N, T, n_mels)
    lengths = torch.tensor(samples, dtype=torch.int64).div(hop_length, rounding_mode="floor") + 1  # (N,)
    real = torch.arange(features.shape[1])[None, :] < lengths[:, None]  # (N, T), True = real frame
    dataset = DTMFDataset(
        features.masked_fill(~real[:, :, None], 0.0),
        torch.tensor(labels, dtype=torch.int64),
        tuple(sequences),
        lengths,
        tuple(times),
    )
    return (dataset, waveforms) if return_waveforms else dataset


@dataclass(frozen=True)
class DTMFSplit:
    """Train, validation and test sets, standardised with the training set's ``mean`` and ``std``."""

    train: DTMFDataset
    val: DTMFDataset
    test: DTMFDataset
    mean: float
    std: float


def make_dtmf_split(
    *, num_train: int = 2000, num_val: int = 500, num_test: int = 500, seed: int = 0, **options: object
) -> DTMFSplit:
    """Independent train, validation and test sets (different seeds derived from ``seed``), standardised.

    The mean and standard deviation come from the training set's real frames; padded frames stay
    zero. ``options`` go to :func:`make_dtmf_dataset` (spectrogram and clip settings).
    """
    train, val, test = (
        make_dtmf_dataset(num, seed=3 * seed + offset, **options)  # type: ignore[arg-type]
        for offset, num in enumerate((num_train, num_val, num_test))
    )
    assert isinstance(train, DTMFDataset) and isinstance(val, DTMFDataset) and isinstance(test, DTMFDataset)
    real = train.features[torch.arange(train.features.shape[1])[None, :] < train.lengths[:, None]]  # (frames, n_mels)
    mean, std = real.mean().item(), real.std().item()

    def standardise(data: DTMFDataset) -> DTMFDataset:
        keep = torch.arange(data.features.shape[1])[None, :, None] < data.lengths[:, None, None]  # (N, T, 1)
        features = ((data.features - mean) / std).masked_fill(~keep, 0.0)  # (N, T, n_mels)
        return dataclasses.replace(data, features=features)

    return DTMFSplit(standardise(train), standardise(val), standardise(test), mean, std)
