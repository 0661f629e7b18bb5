"""Measuring tools: wall time, the largest tensor a call creates, what autograd saves, peak memory.

Apart from the benchmark harness (:mod:`attn_course.bench`) and from the models: a model module
imports no measuring code, and what times or probes a model lives here (the graders read
:func:`saved_tensor_bytes`):

* :func:`time_call`: median wall time of a call, GPU work waited for (:func:`synchronize`);
* :func:`largest_tensor_bytes`: the largest tensor storage any torch call inside a function
  returned -- deterministic, so lessons print it as checked output;
* :func:`saved_tensor_bytes`: the bytes autograd keeps for the backward pass -- deterministic too;
* :func:`fresh_page_bytes`: the memory one call on the CPU received as fresh pages from the
  operating system (its minor page faults), which must be zeroed before first use;
* :func:`peak_memory_bytes`: the extra peak memory of one call, measured: the CUDA allocator's
  peak on a GPU, the process's peak resident set on a CPU (Linux's ``VmHWM``, reset before the
  call; ``ru_maxrss`` elsewhere);
* :func:`measure_decoding_speed`: decoding with and without a KV cache (:mod:`attn_course.kv_cache`),
  timed with :func:`time_call`.

Timings and peak memory depend on the machine and its load: lessons print them in cells whose
output is not compared, and assert only orderings and ratios with margins.
``attn-course bench`` (:mod:`attn_course.bench`) builds its tables from these tools.

Taught in lesson 04 (the cost of attention); lessons 05-07 and 11 use them (11: decoding speed).
"""

from __future__ import annotations

import mmap
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode

from ._checks import check_positive_int
from .kv_cache import KVCache, decode_step
from .multihead import MultiHeadAttention

try:
    import resource  # Unix only
except ImportError:  # pragma: no cover - Windows
    resource = None

__all__ = [
    "synchronize",
    "time_call",
    "largest_tensor_bytes",
    "saved_tensor_bytes",
    "peak_memory_bytes",
    "fresh_page_bytes",
    "measure_decoding_speed",
]


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


def fresh_page_bytes(fn: Callable[[], object]) -> int | None:
    """Bytes of fresh pages one call of ``fn()`` received from the operating system, on the CPU.

    A page the process has never touched (or has handed back) is zeroed and mapped by the
    operating system on its first write, a *minor page fault*; this counts them during one call
    and returns ``faults * page size``. What a call receives depends on what ran before it (the
    memory allocator reuses freed blocks, or hands large ones back), so call it after the calls
    you want it to follow. ``fn`` is called either way; the result is ``None`` where the
    operating system does not count page faults (Windows). With transparent huge pages one
    fault can map 2 MiB, and the count then reads low.
    """
    if resource is None:  # Windows: no page-fault count, but the call still happens
        fn()
        return None
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    fn()
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) * mmap.PAGESIZE


class _LargestStorage(TorchFunctionMode):
    """Records the largest storage of any tensor returned by a torch function."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        for item in result if isinstance(result, (tuple, list)) else (result,):
            if isinstance(item, torch.Tensor) and item.layout == torch.strided:
                self.largest = max(self.largest, item.untyped_storage().nbytes())
        return result


def largest_tensor_bytes(fn: Callable[..., object], *args: object, **kwargs: object) -> int:
    """Bytes of the largest tensor storage that any torch call inside ``fn(*args, **kwargs)`` returned.

    A cheap, deterministic stand-in for peak memory: it shows, for example, that dense
    attention creates an ``(L, S)`` score matrix and chunked attention never does. Views
    count as the storage they look at (an ``expand`` costs nothing). Buffers that a fused
    kernel allocates internally are invisible to it -- use :func:`measure_peak_memory` for those.
    """
    mode = _LargestStorage()
    with mode:
        fn(*args, **kwargs)
    return mode.largest


def saved_tensor_bytes(fn: Callable[..., object], *args: object, **kwargs: object) -> int:
    """Bytes that autograd keeps for the backward pass of ``fn(*args, **kwargs)``.

    Every tensor an operation saves for its backward pass goes through the pack hook of
    ``torch.autograd.graph.saved_tensors_hooks``. Saved tensors often share memory (``k.mT``
    is a view of ``k``; ``x * x`` saves ``x`` twice), so each *storage* is counted once, at
    its full size. Saved inputs count too: the backward pass keeps them alive. Deterministic,
    unlike a peak-memory reading, so lessons print it as checked output. Returns 0 when
    nothing needs a gradient (or under ``torch.no_grad()``).

    Lesson 04 teaches it (forward vs backward memory); lesson 07 uses it for the recomputing
    backward.
    """
    storages: dict[int, int] = {}
    kept: list[torch.Tensor] = []  # hold every saved tensor, so no storage is freed and its address reused

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.layout == torch.strided:
            storage = tensor.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
            kept.append(tensor)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        fn(*args, **kwargs)
    return sum(storages.values())


def _status_bytes(field: str) -> int | None:
    """A ``/proc/self/status`` memory field (``VmRSS``, ``VmHWM``) in bytes, or None off Linux."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _reset_peak_rss() -> bool:
    """Reset this process's peak-RSS counter (VmHWM) to its current RSS; False where unsupported."""
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
        return _status_bytes("VmHWM") is not None
    except OSError:
        return False


def _max_rss_bytes() -> int:
    if resource is None:
        return 0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB on Linux


def peak_memory_bytes(fn: Callable[[], object], *, device: torch.device | str = "cpu") -> dict[str, object]:
    """Run ``fn()`` once and measure the peak memory it added: ``{"bytes", "method", "error"}``.

    * CUDA: ``torch.cuda.max_memory_allocated`` minus what was allocated before the call (the
      allocator's own count: exact, and blind to other processes).
    * CPU: the process's peak resident set during the call minus its resident set before it
      (Linux: ``VmHWM`` after resetting it through ``/proc/self/clear_refs``; elsewhere
      ``ru_maxrss``, which cannot be reset, so only a new high counts). Memory freed earlier
      in the same process may be reused without raising the resident set, so call it in a
      fresh process for a clean figure -- ``attn-course bench attention`` forks one per point.
    * MPS and other devices: ``bytes`` is None and ``error`` says why.

    ``fn``'s result is dropped before the peak is read. Call it under ``torch.no_grad()`` to
    measure inference, or with autograd on to include what is kept for the backward pass.
    """
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        result = fn()
        del result
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device)
        return {"bytes": peak - before, "method": "torch.cuda.max_memory_allocated", "error": None}
    if device.type != "cpu":
        return {"bytes": None, "method": "none", "error": f"no peak-memory counter on {device.type}"}
    reset = _reset_peak_rss()
    before = _status_bytes("VmRSS") if reset else _max_rss_bytes()
    result = fn()
    del result
    after = _status_bytes("VmHWM") if reset else _max_rss_bytes()
    method = "peak RSS (" + ("VmHWM" if reset else "ru_maxrss") + ")"
    return {"bytes": max(0, after - before), "method": method, "error": None}


def measure_decoding_speed(
    module: MultiHeadAttention,
    *,
    batch_size: int = 1,
    prompt_length: int = 16,
    new_tokens: int = 64,
    repeats: int = 3,
    seed: int = 0,
) -> dict[str, float]:
    """Time decoding ``new_tokens`` tokens after a prompt: full recompute per step vs the KV cache.

    Both loops run the attention layer on the same random token embeddings (teacher-forced:
    there is no vocabulary here): the *full* loop calls ``module(x[:, : t + 1], is_causal=True)``
    at every step and keeps the last row; the *cached* loop prefills the prompt once and then
    calls ``decode_step`` with one token per step. Returns median seconds for the whole
    generation (``full_s``, ``cached_s``), the ``speedup`` (``full_s / cached_s``) and
    ``max_abs_diff`` between the two loops' outputs (they compute the same thing).
    """
    prompt_length = check_positive_int("prompt_length", prompt_length)
    new_tokens = check_positive_int("new_tokens", new_tokens)
    repeats = check_positive_int("repeats", repeats)
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be an nn.Module, got {type(module).__name__}")
    weight = module.q_proj.weight
    device = weight.device
    total = prompt_length + new_tokens
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(batch_size, total, module.d_model, generator=generator, dtype=weight.dtype).to(device)  # (B, S, E)

    def full_recompute() -> torch.Tensor:
        rows = [module(x[:, : t + 1], is_causal=True)[:, -1:] for t in range(prompt_length, total)]  # each (B, 1, E)
        return torch.cat(rows, dim=1)  # (B, new_tokens, E)

    def cached() -> torch.Tensor:
        cache = KVCache.for_module(module, batch_size=batch_size, max_length=total)
        decode_step(module, x[:, :prompt_length], cache)  # prefill the prompt in one call
        rows = [decode_step(module, x[:, t : t + 1], cache) for t in range(prompt_length, total)]  # each (B, 1, E)
        return torch.cat(rows, dim=1)  # (B, new_tokens, E)

    was_training = module.training
    module.eval()
    try:
        with torch.no_grad():
            difference = (full_recompute() - cached()).abs().max().item()
            full_s = time_call(full_recompute, device=device, warmup=1, repeats=repeats)
            cached_s = time_call(cached, device=device, warmup=1, repeats=repeats)
    finally:
        module.train(was_training)
    return {
        "batch_size": batch_size,
        "prompt_length": prompt_length,
        "new_tokens": new_tokens,
        "full_s": full_s,
        "cached_s": cached_s,
        "speedup": full_s / cached_s,
        "max_abs_diff": difference,
    }
