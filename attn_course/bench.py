"""Benchmarks that print measured numbers: times, ratios, and the machine's matmul rate.

Run them with ``attn-course bench mha`` (and, as the course grows, other targets).
Every figure is measured in the run that prints it; nothing is typed in.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
import torch.nn as nn

from .multihead import MultiHeadAttention

__all__ = ["synchronize", "time_call", "matmul_gflops", "bench_mha"]


def synchronize(device: torch.device) -> None:
    """Wait for queued GPU work, so a timer measures the work and not its launch."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def time_call(fn: Callable[[], object], *, device: torch.device, warmup: int = 3, repeats: int = 20) -> float:
    """Median wall time of ``fn()`` in seconds, after ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn()
    synchronize(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def matmul_gflops(*, device: torch.device | str = "cpu", n: int = 2048, dtype: torch.dtype = torch.float32) -> float:
    """Measured rate of one ``(n, n) @ (n, n)`` matmul, in GFLOP/s (2 n^3 flops per call)."""
    device = torch.device(device)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    seconds = time_call(lambda: a @ b, device=device, warmup=2, repeats=10)
    return 2 * n**3 / seconds / 1e9


def bench_mha(
    *,
    device: torch.device | str = "cpu",
    batch: int = 8,
    length: int = 256,
    d_model: int = 256,
    num_heads: int = 8,
    rounds: int = 15,
    dtype: torch.dtype = torch.float32,
) -> dict[str, float]:
    """Forward+backward time of ``MultiHeadAttention`` vs ``nn.MultiheadAttention``, same weights.

    The two are timed alternately, ``rounds`` times each, so drifts in machine load hit
    both; the ratio is of the medians. Returns seconds per call for each and the ratio
    ``ours / torch`` (below 1 means ours is faster).
    """
    device = torch.device(device)
    torch.manual_seed(0)
    reference = nn.MultiheadAttention(d_model, num_heads, batch_first=True, device=device, dtype=dtype)
    ours = MultiHeadAttention.from_torch(reference)
    x = torch.randn(batch, length, d_model, device=device, dtype=dtype, requires_grad=True)

    def step_ours() -> None:
        ours(x).sum().backward()

    def step_torch() -> None:
        reference(x, x, x, need_weights=False)[0].sum().backward()

    ours_times, torch_times = [], []
    for _ in range(rounds):
        ours_times.append(time_call(step_ours, device=device, warmup=1, repeats=3))
        torch_times.append(time_call(step_torch, device=device, warmup=1, repeats=3))
    ours_s = statistics.median(ours_times)
    torch_s = statistics.median(torch_times)
    return {
        "batch": batch,
        "length": length,
        "d_model": d_model,
        "num_heads": num_heads,
        "ours_ms": ours_s * 1e3,
        "torch_ms": torch_s * 1e3,
        "ratio": ours_s / torch_s,
    }
