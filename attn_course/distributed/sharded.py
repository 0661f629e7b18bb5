"""One attention call on W processes, from full-size tensors: exactness, bytes sent, peak memory, time.

:func:`run_sharded_attention` takes the whole q, k, v, shards them
(:func:`~attn_course.distributed.layout.shard_sequence`), runs ring attention, Ulysses or
(W = 1) the single-process baseline forward and backward on W new processes
(:func:`~attn_course.distributed.runner.run_distributed`), and gathers the output and the
gradients back in sequence order, with each rank's
:class:`~attn_course.distributed.exchange.CommunicationLog`, extra peak memory and times.
:func:`run_sharded_attention_batch` runs several settings in one process group (one start-up
for all). Every setting is checked before any process starts.

Taught in lesson 12 (attention across devices).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import time
from collections.abc import Sequence

import torch

from .._checks import check_positive_int, shape_str
from ..attention import scaled_dot_product_attention
from ..grouped import grouped_attention
from ._checks import check_shard
from .exchange import CommunicationLog, log_communication, synchronize
from .layout import gather_sequence, sequence_positions, shard_sequence
from .ring import ring_attention
from .runner import run_distributed
from .ulysses import ulysses_attention, ulysses_kv_heads

__all__ = ["METHODS", "ShardedAttentionRun", "run_sharded_attention", "run_sharded_attention_batch"]

METHODS = ("ring", "ulysses", "dense")


@dataclasses.dataclass
class ShardedAttentionRun:
    """The result of :func:`run_sharded_attention`, gathered back in sequence order.

    ``out`` ``(B, H, L, Dv)``; ``grads`` ``(dq, dk, dv)`` (None without ``grad_out``);
    per rank: ``logs`` (:class:`CommunicationLog`), ``peak_bytes`` (extra peak memory of the
    forward and backward passes, or None where it cannot be measured), ``seconds`` (forward
    and backward wall time).
    """

    method: str
    world_size: int
    layout: str
    out: torch.Tensor
    grads: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None
    logs: list[CommunicationLog]
    peak_bytes: list[int | None]
    seconds: list[dict[str, float]]


def _status_bytes(field: str) -> int | None:
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


class _PeakMemory:
    """Extra peak memory of a block of code in this process: CUDA's allocator peak, or the kernel's VmHWM on Linux.

    On Linux the peak-RSS counter is reset (``/proc/self/clear_refs``) just before, and glibc
    is told to serve every allocation of 64 KiB or more with its own ``mmap`` (``mallopt``),
    so memory that is freed goes back to the system at once and the resident set follows the
    live tensors. Elsewhere ``bytes`` stays None.
    """

    def __init__(self, device: torch.device) -> None:
        self.device, self.bytes, self.base = device, None, None

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
            return self
        try:
            libc = ctypes.CDLL(None)
            libc.mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD: fixed, so large blocks are unmapped when freed
            libc.malloc_trim(0)
            with open("/proc/self/clear_refs", "w") as clear_refs:
                clear_refs.write("5")  # reset VmHWM to the current RSS
            self.base = _status_bytes("VmRSS")
        except (OSError, AttributeError):
            self.base = None
        return self

    def __exit__(self, *exc_info) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.bytes = torch.cuda.max_memory_allocated(self.device) - self.base
        elif self.base is not None:
            peak = _status_bytes("VmHWM")
            self.bytes = None if peak is None else max(0, peak - self.base)


def _sharded_worker(rank, world_size, jobs, device_type):
    """One rank of :func:`run_sharded_attention_batch`: run every job in this process group, in order."""
    device = torch.device("cuda", torch.cuda.current_device()) if device_type == "cuda" else torch.device("cpu")
    return [_run_job(rank, world_size, device, *job) for job in jobs]


def _run_job(rank, world_size, device, method, q, k, v, key_padding_mask, grad_out, options):
    """Shard the full tensors, run forward (and backward) with a log and a memory probe, report this rank's part."""
    layout, is_causal, fused, measure_memory = options["layout"], options["is_causal"], options["fused"], options["measure_memory"]
    mine = [shard_sequence(x.to(device), rank, world_size, layout=layout) for x in (q, k, v)]
    q_s, k_s, v_s = (x.requires_grad_(grad_out is not None) for x in mine)  # (B, H, L/W, .)
    keep = None if key_padding_mask is None else shard_sequence(key_padding_mask.to(device), rank, world_size,
                                                                layout=layout, dim=-1)  # (B, L/W)
    dout = None if grad_out is None else shard_sequence(grad_out.to(device), rank, world_size, layout=layout)
    if measure_memory:  # warm the code path on a tiny problem, so one-time set-up is not counted
        tiny = [x[..., :2, :].detach().clone() for x in (q_s, k_s, v_s)]  # (B, H, 2, .) on every rank
        _sharded_call(method, *tiny, None, is_causal, "contiguous", fused)
    seconds = {}
    peak = _PeakMemory(device) if measure_memory else contextlib.nullcontext()
    with log_communication() as log, peak:
        start = _timed_always(device)
        out = _sharded_call(method, q_s, k_s, v_s, keep, is_causal, layout, fused)
        seconds["forward"] = _timed_always(device) - start
        if dout is not None:
            start = _timed_always(device)
            out.backward(dout)
            seconds["backward"] = _timed_always(device) - start
    return {
        "out": out.detach(),
        "grads": None if dout is None else tuple(x.grad for x in (q_s, k_s, v_s)),
        "log": log,
        "peak_bytes": peak.bytes if measure_memory else None,
        "seconds": seconds,
    }


def _timed_always(device: torch.device) -> float:
    synchronize(device)
    return time.perf_counter()


def _sharded_call(method, q, k, v, keep, is_causal, layout, fused):
    if method == "ring":
        return ring_attention(q, k, v, key_padding_mask=keep, is_causal=is_causal, layout=layout)
    if method == "ulysses":
        return ulysses_attention(q, k, v, key_padding_mask=keep, is_causal=is_causal, layout=layout, fused=fused)
    mask = None if keep is None else keep[:, None, None, :]  # (B, 1, 1, L)
    attend = scaled_dot_product_attention if k.shape[1] == q.shape[1] else grouped_attention  # lesson 11's GQA
    return attend(q, k, v, mask, is_causal=is_causal, fused=fused)  # one process, W = 1


def run_sharded_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    method: str = "ring",
    world_size: int = 2,
    key_padding_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    layout: str | None = None,
    grad_out: torch.Tensor | None = None,
    fused: bool | None = None,
    measure_memory: bool = False,
    device: str = "cpu",
    threads: int = 1,
    timeout_s: float = 300.0,
) -> ShardedAttentionRun:
    """Run one attention method on ``world_size`` new processes, from full tensors, and gather the result.

    Args:
        q, k, v: the whole sequence, ``(B, H, L, D)``, ``(B, Hkv, L, D)``, ``(B, Hkv, L, Dv)``
            (``Hkv = H``, or fewer K/V heads shared by groups of query heads, lesson 11).
        method: ``"ring"`` (:func:`ring_attention`), ``"ulysses"`` (:func:`ulysses_attention`)
            or ``"dense"`` (:func:`~attn_course.scaled_dot_product_attention` in one process:
            the baseline; world_size must be 1).
        key_padding_mask: ``(B, L)`` bool, True = real token.
        layout: how the sequence is split (:func:`sequence_positions`); default zig-zag for
            the ring, contiguous otherwise.
        grad_out: ``(B, H, L, Dv)``; if given, the backward pass runs too and the gradients
            of q, k, v come back in ``grads``.
        fused: for ulysses and dense, passed on to the local attention (False = the explicit
            path of lesson 01, whose (L, L) matrices show in the memory).
        measure_memory: measure each rank's extra peak memory of the forward and backward
            passes (see :class:`ShardedAttentionRun`).
        device, threads, timeout_s: as in :func:`run_distributed`.
    """
    settings = dict(method=method, key_padding_mask=key_padding_mask, is_causal=is_causal, layout=layout,
                    grad_out=grad_out, fused=fused, measure_memory=measure_memory)
    return run_sharded_attention_batch([dict(q=q, k=k, v=v, **settings)], world_size=world_size, device=device,
                                       threads=threads, timeout_s=timeout_s)[0]


_SETTINGS = ("q", "k", "v", "method", "key_padding_mask", "is_causal", "layout", "grad_out", "fused", "measure_memory")


def _job(world_size: int, device: str, q, k, v, method="ring", key_padding_mask=None, is_causal=False, layout=None,
         grad_out=None, fused=None, measure_memory=False):
    """Check one setting before any process starts; return it as (method, tensors..., options) for the workers."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if method == "dense" and world_size != 1:
        raise ValueError(f"method='dense' is the single-process baseline: world_size must be 1, got {world_size}")
    layout = layout or ("zigzag" if method == "ring" else "contiguous")
    for name, x in (("q", q), ("k", k), ("v", v)):
        check_shard(name, x)
    if (k.shape[0] != q.shape[0] or k.shape[2:] != q.shape[2:] or v.shape[:3] != k.shape[:3]
            or q.shape[1] % k.shape[1]):
        raise ValueError(f"expected q (B, H, L, D), k (B, Hkv, L, D) and v (B, Hkv, L, Dv) of one sequence, with Hkv "
                         f"dividing H, got q {shape_str(q.shape)}, k {shape_str(k.shape)}, v {shape_str(v.shape)}")
    B, H, L, _ = q.shape
    sequence_positions(L, world_size, layout=layout)  # raises if the world size does not divide the sequence
    if method == "ulysses":
        ulysses_kv_heads(H, k.shape[1], world_size)  # raises if the heads cannot be split over the ranks
    if key_padding_mask is not None and (key_padding_mask.dtype != torch.bool or tuple(key_padding_mask.shape) != (B, L)):
        raise ValueError(f"key_padding_mask must be bool (B, L) = ({B}, {L}), got {key_padding_mask.dtype} "
                         f"{shape_str(key_padding_mask.shape)}")
    if grad_out is not None and tuple(grad_out.shape) != (B, H, L, v.shape[-1]):
        raise ValueError(f"grad_out must be (B, H, L, Dv) = {shape_str((B, H, L, v.shape[-1]))}, got {shape_str(grad_out.shape)}")
    options = {"layout": layout, "is_causal": bool(is_causal), "fused": fused, "measure_memory": bool(measure_memory)}
    tensors = [None if x is None else x.detach().cpu() for x in (q, k, v, key_padding_mask, grad_out)]
    return (method, *tensors, options)


def run_sharded_attention_batch(
    settings: Sequence[dict],
    *,
    world_size: int = 2,
    device: str = "cpu",
    threads: int = 1,
    timeout_s: float = 300.0,
) -> list[ShardedAttentionRun]:
    """:func:`run_sharded_attention` for several settings in one process group (one start-up for all).

    Each setting is a dict of that function's arguments: ``q``, ``k``, ``v`` and optionally
    ``method``, ``key_padding_mask``, ``is_causal``, ``layout``, ``grad_out``, ``fused``,
    ``measure_memory``. Every setting is checked before any process starts.
    """
    check_positive_int("world_size", world_size)
    jobs = []
    for index, setting in enumerate(settings):
        unknown = set(setting) - set(_SETTINGS)
        if unknown:
            raise TypeError(f"setting {index} has unknown keys {sorted(unknown)}; expected some of {_SETTINGS}")
        jobs.append(_job(world_size, device, **setting))
    if not jobs:
        return []
    ranks = run_distributed(_sharded_worker, world_size, jobs, device, device=device, threads=threads,
                            timeout_s=timeout_s)  # ranks[r][j]: rank r's part of job j
    runs = []
    for j, job in enumerate(jobs):
        method, layout = job[0], job[-1]["layout"]
        parts = [ranks[r][j] for r in range(world_size)]
        grads = None
        if parts[0]["grads"] is not None:
            grads = tuple(gather_sequence([p["grads"][i] for p in parts], layout=layout) for i in range(3))
        runs.append(ShardedAttentionRun(
            method=method, world_size=world_size, layout=layout,
            out=gather_sequence([p["out"] for p in parts], layout=layout),  # (B, H, L, Dv)
            grads=grads, logs=[p["log"] for p in parts], peak_bytes=[p["peak_bytes"] for p in parts],
            seconds=[p["seconds"] for p in parts],
        ))
    return runs
