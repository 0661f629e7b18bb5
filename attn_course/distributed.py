"""Attention across processes: ring attention and head-parallel (Ulysses) attention on ``torch.distributed``.

A long sequence does not fit on one device (lesson 04), so it is split along the sequence
axis: each of the W processes ("ranks") holds L / W of the queries, keys and values. Two
ways to still compute exact attention over the whole sequence:

* :func:`ring_attention` (Liu et al. 2023, after Li et al. 2021) -- every rank keeps its
  queries; the key/value blocks travel around a ring of ranks, one hop per step. At each of
  the W steps a rank computes its queries against the block it holds (:func:`ring_step`)
  and merges the result into a running :class:`~attn_course.chunked.PartialAttention` with
  the online softmax of lesson 07. Each step sends one K and one V block to the next rank,
  and the send of the next block overlaps with the computation on the current one. With a
  causal mask the **zig-zag** layout (:func:`sequence_positions`) gives every rank one early
  and one late chunk, so every rank does the same work at every step. The backward pass is a
  custom ``torch.autograd.Function`` that sends the blocks around the ring again, together
  with the gradients of the keys and values, which collect every rank's contribution on the
  way and arrive home after W hops (FlashAttention's recomputing backward, per block).
* :func:`ulysses_attention` (DeepSpeed-Ulysses, Jacobs et al. 2023) -- one all-to-all turns
  "all heads of L / W tokens" into "H / W heads of all L tokens"; each rank runs ordinary
  attention for its heads; a second all-to-all turns the output back. The all-to-all is its
  own adjoint, so its backward pass is the same exchange in reverse.

Both are exact: they equal single-process attention up to rounding (tests: float64, 1e-10,
outputs and gradients, world sizes 1-5, causal, padded).

Around them:

* :func:`run_distributed` starts W processes on this machine (gloo on CPU, NCCL on GPUs),
  runs ``fn(rank, world_size, *args)`` in each and returns the results in rank order. A
  function run in another process must be importable: define it in a module, not in a
  notebook cell.
* :func:`run_sharded_attention` runs one attention method on W processes from full-size
  tensors: it shards them, runs forward (and backward), gathers the output and gradients back
  and returns each rank's communication log and measured peak memory;
  :func:`run_sharded_attention_batch` runs several settings in one process group.
  :func:`rank_summary` is the smallest useful worker: one ``all_reduce``.
* :class:`CommunicationLog` / :func:`log_communication`: every exchange in this module goes
  through a thin wrapper around ``torch.distributed`` that records the bytes this rank sent
  and the time it waited, per phase and step, and the number of scores each step computed.
  "Bytes sent" is what this rank's own data puts on the wire: a send's tensors; for an
  all-to-all the W - 1 chunks that leave the rank; for an all-gather the rank's tensor once
  per other rank.

Shapes: each rank passes its shard q ``(B, H, L/W, D)``, k ``(B, H, L/W, D)``, v ``(B, H,
L/W, Dv)`` and optionally ``key_padding_mask`` ``(B, L/W)`` (bool, True = a real token that
may be attended to, as everywhere in the course) and gets its shard of the output ``(B, H,
L/W, Dv)``. Every rank must pass the same shapes and options.

Taught in lesson 12 (attention across devices).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import math
import multiprocessing
import multiprocessing.connection
import os
import pickle
import socket
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from ._checks import check_positive_int, shape_str
from .attention import scaled_dot_product_attention
from .chunked import PartialAttention, _log_sum_exp, finish_partial, merge_partials, partial_attention

__all__ = [
    "LAYOUTS",
    "sequence_positions",
    "shard_sequence",
    "gather_sequence",
    "ring_schedule",
    "causal_work",
    "CommEvent",
    "WorkEvent",
    "CommunicationLog",
    "log_communication",
    "ring_step",
    "ring_step_backward",
    "ring_attention",
    "ulysses_attention",
    "rank_summary",
    "run_distributed",
    "ShardedAttentionRun",
    "run_sharded_attention",
    "run_sharded_attention_batch",
    "plot_ring_schedule",
    "plot_causal_layout",
]

LAYOUTS = ("contiguous", "zigzag")
METHODS = ("ring", "ulysses", "dense")


# ----------------------------------------------------------------------------------------
# Which tokens live on which rank


def sequence_positions(seq_len: int, world_size: int, *, layout: str = "zigzag") -> list[torch.Tensor]:
    """The positions (token indices) each rank holds, in the order it stores them.

    * ``"contiguous"``: rank r holds tokens ``r L/W .. (r+1) L/W - 1``. With a causal mask
      rank 0's queries see only their own block and the last rank's see everything: the
      last rank does W times the work of the first.
    * ``"zigzag"``: the sequence is cut into 2W chunks of ``L / 2W`` tokens and rank r holds
      chunk r and chunk ``2W - 1 - r`` (one early, one late), so every rank does the same
      causal work. PyTorch's context parallelism calls this the head-tail layout.

    Returns W ``int64`` tensors of length ``L / W``. Raises ``ValueError`` when the world size
    (or, for zig-zag, twice the world size) does not divide the sequence length.
    """
    check_positive_int("seq_len", seq_len)
    check_positive_int("world_size", world_size)
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if seq_len % world_size:
        raise ValueError(
            f"the world size must divide the sequence: sequence length {seq_len} is not divisible by "
            f"world_size = {world_size}; pad the sequence to a multiple of {world_size} "
            f"(e.g. {math.ceil(seq_len / world_size) * world_size}) and mask the padding with key_padding_mask"
        )
    if layout == "contiguous":
        return [row.clone() for row in torch.arange(seq_len).view(world_size, seq_len // world_size)]  # W x (L/W,)
    chunks = 2 * world_size
    if seq_len % chunks:
        raise ValueError(
            f"the zig-zag layout cuts the sequence into 2 * world_size = {chunks} equal chunks, but sequence "
            f"length {seq_len} is not divisible by {chunks}; pad it to {math.ceil(seq_len / chunks) * chunks} "
            "(and mask the padding with key_padding_mask) or use layout='contiguous'"
        )
    chunk = torch.arange(seq_len).view(chunks, seq_len // chunks)  # (2W, L/2W)
    return [torch.cat([chunk[r], chunk[chunks - 1 - r]]) for r in range(world_size)]  # W x (L/W,)


def shard_sequence(x: torch.Tensor, rank: int, world_size: int, *, layout: str = "zigzag", dim: int = -2) -> torch.Tensor:
    """Rank ``rank``'s shard of ``x`` along the sequence axis ``dim`` (a copy, in that rank's order)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in 0..{world_size - 1}, got {rank}")
    positions = sequence_positions(x.shape[dim], world_size, layout=layout)[rank]
    return x.index_select(dim, positions.to(x.device))  # (..., L/W, ...) along dim


def gather_sequence(shards: Sequence[torch.Tensor], *, layout: str = "zigzag", dim: int = -2) -> torch.Tensor:
    """The inverse of :func:`shard_sequence`: put every rank's shard back in sequence order."""
    shards = list(shards)
    if not shards:
        raise ValueError("shards is empty: give one tensor per rank")
    world_size = len(shards)
    stacked = torch.cat(shards, dim=dim)  # (..., L, ...) in rank order
    positions = torch.cat(sequence_positions(stacked.shape[dim], world_size, layout=layout))  # (L,)
    inverse = torch.argsort(positions).to(stacked.device)  # (L,): where each position sits in rank order
    return stacked.index_select(dim, inverse)  # (..., L, ...) in sequence order


def ring_schedule(world_size: int) -> list[list[int]]:
    """``schedule[rank][step]``: whose K/V block each rank holds at each step of the ring.

    Every step each rank passes its block to rank ``rank + 1`` and receives one from
    ``rank - 1``, so at step t rank r holds the block of rank ``(r - t) mod W``.
    """
    check_positive_int("world_size", world_size)
    return [[(rank - step) % world_size for step in range(world_size)] for rank in range(world_size)]


# ----------------------------------------------------------------------------------------
# Blocks of scores: which pairs of (query run, key run) a ring step must compute


def _runs(positions: list[int], max_length: int | None = None) -> list[tuple[int, int]]:
    """Index ranges ``[start, stop)`` of consecutive increasing positions, at most ``max_length`` long.

    A zig-zag shard is two runs (its early and its late chunk); on a rank whose two chunks
    happen to touch (the middle rank), ``max_length`` = one chunk keeps them apart, so every
    rank computes blocks of the same size.
    """
    runs, start = [], 0
    for i in range(1, len(positions) + 1):
        if i == len(positions) or positions[i] != positions[i - 1] + 1 or (max_length and i - start == max_length):
            runs.append((start, i))
            start = i
    return runs


_MAX_RUNS = 8  # beyond this (e.g. a striped layout) one masked block is cheaper than many tiny ones


def _block_plan(
    q_positions: torch.Tensor,
    k_positions: torch.Tensor,
    *,
    is_causal: bool,
    device: torch.device | None = None,
    max_run: int | None = None,
):
    """The blocks of one ring step: ``[(q_slice, k_slice, causal_mask_or_None)]``, skipping empty ones.

    A block whose keys all come after its queries is skipped; a block whose keys all come
    before needs no causal mask; only blocks on the diagonal get one, built from the global
    positions (not the local indices: with the zig-zag layout they differ).
    """
    q_positions, k_positions = q_positions.cpu(), k_positions.cpu()
    q_list, k_list = q_positions.tolist(), k_positions.tolist()
    q_runs, k_runs = _runs(q_list, max_run), _runs(k_list, max_run)
    if len(q_runs) * len(k_runs) > _MAX_RUNS**2:
        q_runs, k_runs = [(0, len(q_list))], [(0, len(k_list))]
    plan = []
    for q0, q1 in q_runs:
        for k0, k1 in k_runs:
            causal = None
            if is_causal:
                q_pos, k_pos = q_positions[q0:q1], k_positions[k0:k1]
                if int(k_pos.min()) > int(q_pos.max()):
                    continue  # every key lies in every query's future
                if int(k_pos.max()) > int(q_pos.min()):
                    causal = k_pos[None, :] <= q_pos[:, None]  # (cq, ck), True = may attend
                    if not bool(causal.any()):
                        continue
            if causal is not None and device is not None:
                causal = causal.to(device)
            plan.append((slice(q0, q1), slice(k0, k1), causal))
    return plan


def _chunk_length(local_length: int, layout: str) -> int:
    """Tokens per chunk of a rank's shard: half of it for zig-zag (two chunks), all of it otherwise."""
    return local_length // 2 if layout == "zigzag" else local_length


def causal_work(seq_len: int, world_size: int, *, layout: str = "zigzag", is_causal: bool = True) -> torch.Tensor:
    """Scores each rank computes at each ring step, per batch element and head: ``(W, W)`` int64.

    Entry ``[rank, step]`` counts the query-key pairs in the blocks :func:`ring_attention`
    computes (a diagonal block counts whole: it is computed, then half of it masked). The
    ring's own :class:`CommunicationLog` records the same numbers while it runs.
    """
    positions = sequence_positions(seq_len, world_size, layout=layout)
    work = torch.zeros(world_size, world_size, dtype=torch.int64)  # (W, W)
    for rank in range(world_size):
        for step, source in enumerate(ring_schedule(world_size)[rank]):
            plan = _block_plan(positions[rank], positions[source], is_causal=is_causal,
                               max_run=_chunk_length(seq_len // world_size, layout))
            work[rank, step] = sum((qs.stop - qs.start) * (ks.stop - ks.start) for qs, ks, _ in plan)
    return work


# ----------------------------------------------------------------------------------------
# The communication log: every exchange goes through the wrappers below


@dataclasses.dataclass(frozen=True)
class CommEvent:
    """One exchange seen from one rank: what it sent, how many bytes, how long it waited."""

    op: str  # "send/recv", "all-to-all" or "all-gather"
    what: str  # e.g. "k, v", "dk, dv", "q", "key mask"
    phase: str  # "forward" or "backward"
    step: int  # the ring step (0 for the collectives)
    bytes_sent: int
    seconds: float  # time spent waiting for the exchange to finish


@dataclasses.dataclass(frozen=True)
class WorkEvent:
    """One step of computation on one rank: scores computed (over all batch elements and heads) and time."""

    phase: str
    step: int
    scores: int
    seconds: float


@dataclasses.dataclass
class CommunicationLog:
    """What one rank sent and computed, event by event. Filled in by :func:`log_communication`."""

    events: list[CommEvent] = dataclasses.field(default_factory=list)
    work: list[WorkEvent] = dataclasses.field(default_factory=list)

    @staticmethod
    def _keep(event, phase, step, what=None):
        return ((phase is None or event.phase == phase) and (step is None or event.step == step)
                and (what is None or getattr(event, "what", None) == what))

    def bytes_sent(self, *, phase: str | None = None, step: int | None = None, what: str | None = None) -> int:
        """Total bytes this rank sent, optionally for one phase / step / kind of tensor."""
        return sum(e.bytes_sent for e in self.events if self._keep(e, phase, step, what))

    def comm_seconds(self, *, phase: str | None = None) -> float:
        """Seconds this rank spent waiting for exchanges to finish."""
        return sum(e.seconds for e in self.events if self._keep(e, phase, None))

    def compute_seconds(self, *, phase: str | None = None) -> float:
        """Seconds this rank spent computing attention blocks."""
        return sum(w.seconds for w in self.work if self._keep(w, phase, None))

    def scores(self, *, phase: str | None = None, step: int | None = None) -> int:
        """Scores (query-key pairs, over all batch elements and heads) this rank computed."""
        return sum(w.scores for w in self.work if self._keep(w, phase, step))


_ACTIVE_LOGS: list[CommunicationLog] = []


@contextlib.contextmanager
def log_communication() -> Iterator[CommunicationLog]:
    """Record every exchange and every block of work of this module's functions in this process.

    ::

        with log_communication() as log:
            out = ring_attention(q, k, v)
        log.bytes_sent(phase="forward")
    """
    log = CommunicationLog()
    _ACTIVE_LOGS.append(log)
    try:
        yield log
    finally:
        _ACTIVE_LOGS.remove(log)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _record(event: CommEvent | WorkEvent) -> None:
    for log in _ACTIVE_LOGS:
        (log.events if isinstance(event, CommEvent) else log.work).append(event)


def _nbytes(tensors: Sequence[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _group_rank_size(group) -> tuple[int, int]:
    """(rank, world size) in ``group``; (0, 1) when no process group is running."""
    if not (dist.is_available() and dist.is_initialized()):
        if group is not None:
            raise RuntimeError("a process group was passed but torch.distributed is not initialised")
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _global_rank(group, rank: int) -> int:
    return rank if group is None or group is dist.GroupMember.WORLD else dist.get_global_rank(group, rank)


class _RingExchange:
    """Send tensors to the next rank and receive the same shapes from the previous one, asynchronously."""

    def __init__(self, tensors: Sequence[torch.Tensor], group, *, what: str, phase: str, step: int) -> None:
        rank, world_size = _group_rank_size(group)
        self.meta = (what, phase, step)
        self.sent = [t.contiguous() for t in tensors]  # kept alive until the send completes
        self.received = [torch.empty_like(t) for t in self.sent]
        following = _global_rank(group, (rank + 1) % world_size)
        previous = _global_rank(group, (rank - 1) % world_size)
        ops = [dist.P2POp(dist.isend, t, following, group) for t in self.sent]
        ops += [dist.P2POp(dist.irecv, t, previous, group) for t in self.received]
        self.requests = dist.batch_isend_irecv(ops)

    def wait(self) -> list[torch.Tensor]:
        start = time.perf_counter()
        for request in self.requests:
            request.wait()
        _synchronize(self.sent[0].device)
        what, phase, step = self.meta
        _record(CommEvent("send/recv", what, phase, step, _nbytes(self.sent), time.perf_counter() - start))
        return self.received


def _all_to_all(x: torch.Tensor, group, *, what: str, phase: str) -> torch.Tensor:
    """``x`` ``(W, ...)``: chunk ``w`` goes to rank ``w``; returns ``(W, ...)`` with chunk ``w`` from rank ``w``."""
    _, world_size = _group_rank_size(group)
    x = x.contiguous()
    if world_size == 1:
        return x.clone()
    out = torch.empty_like(x)
    start = time.perf_counter()
    dist.all_to_all_single(out, x, group=group)
    _synchronize(x.device)
    sent = _nbytes([x]) * (world_size - 1) // world_size  # the chunk for this rank itself stays here
    _record(CommEvent("all-to-all", what, phase, 0, sent, time.perf_counter() - start))
    return out


def _all_gather(x: torch.Tensor, group, *, what: str, phase: str) -> list[torch.Tensor]:
    _, world_size = _group_rank_size(group)
    x = x.contiguous()
    if world_size == 1:
        return [x]
    out = [torch.empty_like(x) for _ in range(world_size)]
    start = time.perf_counter()
    dist.all_gather(out, x, group=group)
    _synchronize(x.device)
    _record(CommEvent("all-gather", what, phase, 0, _nbytes([x]) * (world_size - 1), time.perf_counter() - start))
    return out


# ----------------------------------------------------------------------------------------
# One ring step, forward and backward


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float16 / bfloat16 are computed in float32, as in lesson 07."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _empty_partial(rows: torch.Tensor, value_dim: int) -> PartialAttention:
    """The partial result of attending to no key yet, for ``rows`` ``(B, H, Lq, ...)``."""
    shape = rows.shape[:-1]
    return PartialAttention(
        acc=rows.new_zeros(*shape, value_dim),  # (B, H, Lq, Dv)
        row_max=rows.new_full((*shape, 1), float("-inf")),  # (B, H, Lq, 1)
        row_sum=rows.new_zeros(*shape, 1),  # (B, H, Lq, 1)
    )


def _allowed(key_keep: torch.Tensor | None, ks: slice, causal: torch.Tensor | None) -> torch.Tensor | None:
    """Boolean ``(B, 1, cq, ck)`` (or broadcastable) of allowed pairs in one block, or None for all."""
    allowed = None if key_keep is None else key_keep[:, None, None, ks]  # (B, 1, 1, ck)
    if causal is not None:
        allowed = causal if allowed is None else allowed & causal  # (B, 1, cq, ck)
    return allowed


def _ring_step(running, q_scaled, k, v, plan, key_keep) -> tuple[PartialAttention, int]:
    """Merge the block ``(k, v)`` into ``running`` for the pre-scaled queries; returns (partial, scores computed)."""
    compute = q_scaled.dtype
    if running is None:
        running = _empty_partial(q_scaled, v.shape[-1])
    pieces: dict[tuple[int, int], PartialAttention] = {}
    computed = 0
    for qs, ks, causal in plan:
        scores = torch.matmul(q_scaled[..., qs, :], k[..., ks, :].to(compute).transpose(-2, -1))  # (B, H, cq, ck)
        allowed = _allowed(key_keep, ks, causal)
        if allowed is not None:
            scores = scores.masked_fill(~allowed, float("-inf"))  # (B, H, cq, ck)
        part = partial_attention(scores, v[..., ks, :].to(compute))  # lesson 07: (acc, max, sum) of this block
        key = (qs.start, qs.stop)
        pieces[key] = part if key not in pieces else merge_partials(pieces[key], part)
        computed += scores.numel()
    if not pieces:
        return running, 0
    rows = []
    start = 0
    for (q0, q1), part in sorted(pieces.items()):
        if q0 > start:  # rows no block reached this step keep their running value
            rows.append(PartialAttention(*(t[..., start:q0, :] for t in running)))
        old = PartialAttention(*(t[..., q0:q1, :] for t in running))
        rows.append(merge_partials(old, part))  # the online-softmax merge of lesson 07
        start = q1
    if start < q_scaled.shape[-2]:
        rows.append(PartialAttention(*(t[..., start:, :] for t in running)))
    return PartialAttention(*(torch.cat(parts, dim=-2) for parts in zip(*rows))), computed  # (B, H, Lq, .)


def _check_shard(name: str, x: object, *, dims: int = 4) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != dims:
        raise ValueError(f"{name} must be (B, H, L/W, D) with {dims} dims, got shape {shape_str(x.shape)}")
    if not x.dtype.is_floating_point:
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {x.dtype}")
    return x


def _check_block(q, k, v, key_padding_mask, *, same_length: bool) -> None:
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check_shard(name, x)
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k and v must share one dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k and v must be on one device, got q {q.device}, k {k.device}, v {v.device}")
    if k.shape[:2] != q.shape[:2] or v.shape[:3] != k.shape[:3] or k.shape[-1] != q.shape[-1]:
        raise ValueError(
            f"expected q (B, H, Lq, D), k (B, H, Lk, D), v (B, H, Lk, Dv) with the same B and H, got q "
            f"{shape_str(q.shape)}, k {shape_str(k.shape)}, v {shape_str(v.shape)}"
        )
    if same_length and k.shape[-2] != q.shape[-2]:
        raise ValueError(
            f"each rank holds the same number of queries and keys (a shard of one sequence), got q "
            f"{shape_str(q.shape)} and k {shape_str(k.shape)}"
        )
    if key_padding_mask is not None:
        if not isinstance(key_padding_mask, torch.Tensor) or key_padding_mask.dtype != torch.bool:
            raise TypeError(
                "key_padding_mask must be a bool tensor (True = a real token that may be attended to), got "
                + (f"dtype {key_padding_mask.dtype}" if isinstance(key_padding_mask, torch.Tensor)
                   else type(key_padding_mask).__name__)
            )
        expected = (k.shape[0], k.shape[-2])
        if tuple(key_padding_mask.shape) != expected:
            raise ValueError(
                f"key_padding_mask must be (B, Lk) = {shape_str(expected)} for this rank's keys, got "
                f"{shape_str(key_padding_mask.shape)}"
            )
        if key_padding_mask.device != k.device:
            raise ValueError(f"key_padding_mask is on {key_padding_mask.device} but k is on {k.device}")


def _scale(scale: float | None, head_dim: int) -> float:
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a float or None, got {type(scale).__name__}")
    return float(scale)


def _positions(name: str, positions: object, length: int, device: torch.device) -> torch.Tensor:
    if not isinstance(positions, torch.Tensor) or positions.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"{name} must be an integer tensor of token positions, got {type(positions).__name__}")
    if tuple(positions.shape) != (length,):
        raise ValueError(f"{name} must have shape ({length},) (one position per token), got {shape_str(positions.shape)}")
    return positions.to(device=device, dtype=torch.int64)


def ring_step(
    running: PartialAttention | tuple | None,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    q_positions: torch.Tensor,
    k_positions: torch.Tensor,
    key_padding_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
) -> PartialAttention:
    """One step of ring attention: merge this rank's queries' attention over one arriving K/V block.

    Args:
        running: the :class:`~attn_course.chunked.PartialAttention` over the blocks seen so
            far (``(acc, row_max, row_sum)``), or None at the first step.
        q: this rank's queries ``(B, H, Lq, D)``; k, v: the block ``(B, H, Lk, D)``, ``(B, H, Lk, Dv)``.
        q_positions, k_positions: ``(Lq,)``, ``(Lk,)`` global token positions; the causal mask
            compares these (query at position i sees keys at positions <= i), never local indices.
        key_padding_mask: ``(B, Lk)`` bool, True = a real key; it travels with the block.
        is_causal: apply the causal mask; blocks entirely in the future are skipped.
        scale: default ``1 / sqrt(D)``.

    Returns the merged partial ``(B, H, Lq, .)``; :func:`~attn_course.chunked.finish_partial`
    turns it into the output after the last step. Rows with no allowed key so far stay finite.
    """
    _check_block(q, k, v, key_padding_mask, same_length=False)
    q_positions = _positions("q_positions", q_positions, q.shape[-2], q.device)
    k_positions = _positions("k_positions", k_positions, k.shape[-2], q.device)
    compute = _compute_dtype(q.dtype)
    if running is not None:
        running = PartialAttention(*(t.to(compute) for t in running))
    q_scaled = q.to(compute) * _scale(scale, q.shape[-1])  # (B, H, Lq, D)
    plan = _block_plan(q_positions, k_positions, is_causal=bool(is_causal), device=q.device)
    partial, _ = _ring_step(running, q_scaled, k, v, plan, key_padding_mask)
    return partial


def _ring_step_backward(q, k, v, grad_out, delta, lse, plan, key_keep, scale):
    """Gradient contributions of one block (FlashAttention's backward): (dq, dk, dv, scores computed)."""
    compute = grad_out.dtype
    grad_q = torch.zeros(q.shape, dtype=compute, device=q.device)  # (B, H, Lq, D)
    grad_k = torch.zeros(k.shape, dtype=compute, device=k.device)  # (B, H, Lk, D)
    grad_v = torch.zeros(v.shape, dtype=compute, device=v.device)  # (B, H, Lk, Dv)
    computed = 0
    for qs, ks, causal in plan:
        q_block = q[..., qs, :].to(compute)  # (B, H, cq, D)
        k_block, v_block = k[..., ks, :].to(compute), v[..., ks, :].to(compute)  # (B, H, ck, D), (B, H, ck, Dv)
        dout = grad_out[..., qs, :]  # (B, H, cq, Dv)
        scores = torch.matmul(q_block * scale, k_block.transpose(-2, -1))  # (B, H, cq, ck), as in the forward pass
        allowed = _allowed(key_keep, ks, causal)
        if allowed is not None:
            scores = scores.masked_fill(~allowed, float("-inf"))
        weights = torch.exp(scores - lse[..., qs, :])  # (B, H, cq, ck): the final softmax weights of this block
        grad_v[..., ks, :] += torch.matmul(weights.transpose(-2, -1), dout)  # (B, H, ck, Dv)
        grad_weights = torch.matmul(dout, v_block.transpose(-2, -1))  # (B, H, cq, ck)
        grad_scores = weights * (grad_weights - delta[..., qs, :]) * scale  # (B, H, cq, ck)
        grad_q[..., qs, :] += torch.matmul(grad_scores, k_block)  # (B, H, cq, D)
        grad_k[..., ks, :] += torch.matmul(grad_scores.transpose(-2, -1), q_block)  # (B, H, ck, D)
        computed += scores.numel()
    return grad_q, grad_k, grad_v, computed


def _safe_lse(lse: torch.Tensor) -> torch.Tensor:
    """Rows with no allowed key have lse = -inf and all scores -inf: use 0, so exp(-inf - 0) = 0."""
    return torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))  # (B, H, Lq, 1)


def ring_step_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    grad_out: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    q_positions: torch.Tensor,
    k_positions: torch.Tensor,
    key_padding_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One block's share of the gradients: ``(dq_part, dk, dv)`` for queries q against the block (k, v).

    ``out`` ``(B, H, Lq, Dv)`` and ``lse`` ``(B, H, Lq, 1)`` are the *final* output and
    log-sum-exp of the queries over all keys (after the whole ring), ``grad_out`` the
    gradient of the loss with respect to ``out``. With ``P = exp(scores - lse)`` and
    ``delta = rowsum(grad_out * out)``: ``dv = P^T grad_out``, ``dS = P (grad_out v^T - delta)``,
    ``dq_part = dS k scale``, ``dk = dS^T q scale``. Summing ``dq_part`` over all blocks gives
    dq; summing ``dk``, ``dv`` over all ranks' queries gives the block's gradients.
    """
    _check_block(q, k, v, key_padding_mask, same_length=False)
    q_positions = _positions("q_positions", q_positions, q.shape[-2], q.device)
    k_positions = _positions("k_positions", k_positions, k.shape[-2], q.device)
    compute = _compute_dtype(q.dtype)
    grad_out, out = grad_out.to(compute), out.to(compute)
    delta = (grad_out * out).sum(dim=-1, keepdim=True)  # (B, H, Lq, 1)
    plan = _block_plan(q_positions, k_positions, is_causal=bool(is_causal), device=q.device)
    dq, dk, dv, _ = _ring_step_backward(q, k, v, grad_out, delta, _safe_lse(lse.to(compute)), plan,
                                        key_padding_mask, _scale(scale, q.shape[-1]))
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


# ----------------------------------------------------------------------------------------
# Ring attention


def _timed(device: torch.device):
    """A stopwatch that waits for the GPU before reading the clock, only while a log is recording."""
    if _ACTIVE_LOGS:
        _synchronize(device)
    return time.perf_counter()


class _RingAttention(torch.autograd.Function):
    """Ring attention with a recomputing backward pass (saves q, k, v, out and lse; no weights)."""

    @staticmethod
    def forward(ctx, q, k, v, key_keep, is_causal, layout, scale, group):
        rank, world_size = _group_rank_size(group)
        positions = sequence_positions(q.shape[-2] * world_size, world_size, layout=layout)  # on the CPU
        chunk = _chunk_length(q.shape[-2], layout)
        plans = [_block_plan(positions[rank], positions[source], is_causal=is_causal, device=q.device, max_run=chunk)
                 for source in ring_schedule(world_size)[rank]]
        compute = _compute_dtype(q.dtype)
        q_scaled = q.to(compute) * scale  # (B, H, L/W, D)
        block = [k, v] + ([key_keep] if key_keep is not None else [])
        what = "k, v" + (", key mask" if key_keep is not None else "")
        running = None
        for step in range(world_size):
            # Post the exchange of the block we hold before computing on it: the transfer of
            # the next block overlaps with this step's arithmetic.
            pending = _RingExchange(block, group, what=what, phase="forward", step=step) if step < world_size - 1 else None
            start = _timed(q.device)
            running, computed = _ring_step(running, q_scaled, block[0], block[1], plans[step],
                                           block[2] if key_keep is not None else None)
            _record(WorkEvent("forward", step, computed, _timed(q.device) - start))
            if pending is not None:
                block = pending.wait()
        out = finish_partial(running)  # (B, H, L/W, Dv)
        lse = _log_sum_exp(running)  # (B, H, L/W, 1)
        ctx.save_for_backward(q, k, v, out, lse, key_keep)
        ctx.options = (plans, scale, group, what)
        return out.to(q.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        q, k, v, out, lse, key_keep = ctx.saved_tensors
        plans, scale, group, what = ctx.options
        _, world_size = _group_rank_size(group)
        compute = out.dtype
        grad_out = grad_out.to(compute)
        delta = (grad_out * out).sum(dim=-1, keepdim=True)  # (B, H, L/W, 1)
        lse = _safe_lse(lse)
        grad_q = torch.zeros(q.shape, dtype=compute, device=q.device)  # (B, H, L/W, D)
        block = [k, v] + ([key_keep] if key_keep is not None else [])
        incoming = None  # the gradients of the block we hold, summed over the ranks it has visited
        for step in range(world_size):
            pending = _RingExchange(block, group, what=what, phase="backward", step=step) if step < world_size - 1 else None
            start = _timed(q.device)
            dq, dk, dv, computed = _ring_step_backward(q, block[0], block[1], grad_out, delta, lse, plans[step],
                                                       block[2] if key_keep is not None else None, scale)
            grad_q += dq
            _record(WorkEvent("backward", step, computed, _timed(q.device) - start))
            if incoming is not None:
                dk_so_far, dv_so_far = incoming.wait()
                dk, dv = dk_so_far + dk, dv_so_far + dv
            # Pass the block's gradients on with the block: after W hops they are home, complete.
            incoming = _RingExchange([dk, dv], group, what="dk, dv", phase="backward", step=step) if world_size > 1 else None
            if pending is not None:
                block = pending.wait()
        if incoming is not None:
            dk, dv = incoming.wait()
        return grad_q.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None


def _check_layout_fits(name: str, local_length: int, world_size: int, layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if layout == "zigzag" and local_length % 2:
        raise ValueError(
            f"{name}: the zig-zag layout gives each rank two equal chunks, so each rank's shard must hold an even "
            f"number of tokens; got {local_length} per rank (sequence {local_length * world_size} on {world_size} "
            f"ranks). Pad the sequence to a multiple of {2 * world_size} and mask the padding, or use layout='contiguous'"
        )


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    key_padding_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    layout: str = "zigzag",
    scale: float | None = None,
    group: Any = None,
) -> torch.Tensor:
    """Exact attention over a sequence split across the ranks of ``group``; K/V blocks travel around a ring.

    Call it on every rank with that rank's shard (laid out by :func:`sequence_positions`
    with the same ``layout``): q ``(B, H, L/W, D)``, k ``(B, H, L/W, D)``, v ``(B, H, L/W,
    Dv)``, ``key_padding_mask`` ``(B, L/W)`` (True = real token). Returns this rank's output
    ``(B, H, L/W, Dv)``, equal to the matching rows of single-process attention. The
    backward pass (a collective too: every rank must call it) gives exact gradients.

    Without a running process group it runs as a single process (W = 1): lesson 07's
    online softmax over the whole sequence.
    """
    _check_block(q, k, v, key_padding_mask, same_length=True)
    _, world_size = _group_rank_size(group)
    _check_layout_fits("ring_attention", q.shape[-2], world_size, layout)
    with torch.autocast(device_type=q.device.type, enabled=False):
        out = _RingAttention.apply(q, k, v, key_padding_mask, bool(is_causal), layout, _scale(scale, q.shape[-1]), group)
    return out


# ----------------------------------------------------------------------------------------
# Ulysses: all-to-all head parallelism


class _AllToAll(torch.autograd.Function):
    """An all-to-all over dim 0; its adjoint is the same all-to-all, so the backward pass is one too."""

    @staticmethod
    def forward(ctx, x, group, what):
        ctx.options = (group, what)
        return _all_to_all(x, group, what=what, phase="forward")

    @staticmethod
    def backward(ctx, grad):
        group, what = ctx.options
        return _all_to_all(grad, group, what="grad " + what, phase="backward"), None, None


def ulysses_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    key_padding_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    layout: str = "contiguous",
    scale: float | None = None,
    fused: bool | None = None,
    group: Any = None,
) -> torch.Tensor:
    """Exact attention over a sequence split across ranks, by head parallelism (DeepSpeed-Ulysses).

    Each rank passes its sequence shard q ``(B, H, L/W, D)``, k, v likewise, and
    ``key_padding_mask`` ``(B, L/W)``. An all-to-all hands head group g (``H / W`` heads) of
    every shard to rank g, which then holds ``(B, H/W, L, D)``: all tokens of its heads. It
    runs :func:`~attn_course.scaled_dot_product_attention` on them (``fused`` as there), and
    a second all-to-all returns each rank's tokens with all heads: ``(B, H, L/W, Dv)``. The
    number of heads must be a multiple of the world size.
    """
    _check_block(q, k, v, key_padding_mask, same_length=True)
    _, world_size = _group_rank_size(group)
    B, H, local, _ = q.shape
    if H % world_size:
        raise ValueError(
            f"ulysses_attention splits the H = {H} heads over world_size = {world_size} ranks, so H must be a "
            f"multiple of the world size; use {[w for w in range(1, H + 1) if H % w == 0]} ranks, or ring_attention"
        )
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    _check_layout_fits("ulysses_attention", local, world_size, layout)
    group_heads, seq_len = H // world_size, local * world_size

    def to_heads(x: torch.Tensor, what: str) -> torch.Tensor:
        E = x.shape[-1]
        x = x.reshape(B, world_size, group_heads, local, E)  # (B, W, H/W, L/W, E): heads in W groups
        x = x.permute(1, 0, 2, 3, 4)  # (W, B, H/W, L/W, E): group g is sent to rank g
        x = _AllToAll.apply(x, group, what)  # (W, B, H/W, L/W, E): entry w is now rank w's tokens
        return x.permute(1, 2, 0, 3, 4).reshape(B, group_heads, seq_len, E)  # (B, H/W, L, E) in rank order

    def to_sequence(x: torch.Tensor) -> torch.Tensor:
        E = x.shape[-1]
        x = x.reshape(B, group_heads, world_size, local, E)  # (B, H/W, W, L/W, E): the W ranks' tokens
        x = x.permute(2, 0, 1, 3, 4)  # (W, B, H/W, L/W, E): rank w's tokens go back to rank w
        x = _AllToAll.apply(x, group, "out")  # (W, B, H/W, L/W, E): entry g is head group g
        return x.permute(1, 0, 2, 3, 4).reshape(B, H, local, E)  # (B, H, L/W, E)

    q_heads, k_heads, v_heads = to_heads(q, "q"), to_heads(k, "k"), to_heads(v, "v")  # (B, H/W, L, .)
    positions = torch.cat(sequence_positions(seq_len, world_size, layout=layout)).to(q.device)  # (L,) rank order
    in_order = bool(torch.equal(positions, torch.arange(seq_len, device=q.device)))
    order = torch.argsort(positions)  # (L,): rank-order index of each position
    if not in_order:  # put the tokens in sequence order, so a causal mask is the usual triangle
        q_heads, k_heads, v_heads = (x.index_select(-2, order) for x in (q_heads, k_heads, v_heads))  # (B, H/W, L, .)
    mask = None
    if key_padding_mask is not None:
        keep = torch.cat(_all_gather(key_padding_mask, group, what="key mask", phase="forward"), dim=-1)  # (B, L)
        mask = keep.index_select(-1, order)[:, None, None, :]  # (B, 1, 1, L) in sequence order
    out = scaled_dot_product_attention(q_heads, k_heads, v_heads, mask, is_causal=bool(is_causal),
                                       scale=_scale(scale, q.shape[-1]), fused=fused)  # (B, H/W, L, Dv)
    if not in_order:
        out = out.index_select(-2, positions)  # (B, H/W, L, Dv) back in rank order
    return to_sequence(out)


# ----------------------------------------------------------------------------------------
# Running W processes on this machine


class RemoteTraceback(Exception):
    """The traceback of an exception raised in a worker process (attached as ``__cause__``)."""

    def __str__(self) -> str:
        return "\n" + self.args[0]


def _loopback_interface() -> str | None:
    try:
        names = [name for _, name in socket.if_nameindex()]
    except (OSError, AttributeError):
        return None
    return next((name for name in names if name.startswith("lo")), None)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _to_cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {key: _to_cpu(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(_to_cpu(item) for item in value)
    return value


def _send(connection, message) -> None:
    # Plain pickle, by value: torch registers a multiprocessing pickler that would pass tensors as
    # shared-memory handles, which die with the worker before the parent reads them.
    connection.send_bytes(pickle.dumps(message))


def _worker(rank, world_size, port, backend, device_type, threads, timeout_s, job, connection) -> None:
    """The body of one worker process: join the group, run ``fn``, send back ("ok", result) or ("error", ...)."""
    stage = "start"
    try:
        fn, args = pickle.loads(job)
        if backend == "gloo" and "GLOO_SOCKET_IFNAME" not in os.environ and (loopback := _loopback_interface()):
            os.environ["GLOO_SOCKET_IFNAME"] = loopback  # keep gloo's own sockets on 127.0.0.1 too
        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
        torch.set_num_threads(threads)
        if device_type == "cuda":
            torch.cuda.set_device(rank)
        stage = "join"
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout_s))
        stage = "run"
        try:
            result = fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
        _send(connection, ("ok", _to_cpu(result)))
    except BaseException as exc:  # reported to the parent, which raises it
        kind = type(exc)
        _send(connection, ("error", (kind.__module__, kind.__qualname__, str(exc), traceback.format_exc(), stage)))
    finally:
        connection.close()


def _context():
    """A forkserver (workers fork from a process that has imported torch once: fast) or, elsewhere, spawn."""
    if "forkserver" in multiprocessing.get_all_start_methods():
        context = multiprocessing.get_context("forkserver")
        # torch.autograd.backward(out, grad) imports sympy (about 1 s) on first use: do it once, here.
        context.set_forkserver_preload(["attn_course.distributed", "torch.fx.experimental.symbolic_shapes"])
        return context
    return multiprocessing.get_context("spawn")


def _error(rank: int, world_size: int, detail) -> BaseException:
    module, name, message, remote = detail
    import builtins

    kind = getattr(builtins, name, None) if module == "builtins" else None
    text = f"rank {rank} of {world_size}: {message}"
    error = kind(text) if isinstance(kind, type) and issubclass(kind, Exception) else RuntimeError(f"{text} ({module}.{name})")
    error.__cause__ = RemoteTraceback(remote)
    return error


def rank_summary(rank: int, world_size: int) -> dict[str, object]:
    """What one process of :func:`run_distributed` sees: its rank, the group, and one collective.

    Every rank contributes ``rank + 1`` to an ``all_reduce`` (a collective: every rank must
    call it, and each gets the sum), so the result proves the processes talk to each other.
    """
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    total = torch.tensor([rank + 1.0], device=device)
    dist.all_reduce(total)  # sum over the ranks, the same on every rank
    return {"rank": dist.get_rank(), "world_size": dist.get_world_size(), "backend": dist.get_backend(),
            "all_reduce of rank + 1": int(total.item())}


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    device: str = "cpu",
    backend: str | None = None,
    threads: int = 1,
    timeout_s: float = 300.0,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` new processes joined in a process group.

    Each process joins a ``torch.distributed`` group over ``127.0.0.1`` (a free port; gloo's
    sockets on the loopback interface), with backend ``gloo`` for ``device="cpu"`` and
    ``nccl`` for ``device="cuda"`` (rank r uses GPU r), and ``threads`` PyTorch threads: the
    processes share this machine's cores. Returns the W results in rank order (tensors
    moved to the CPU). If a rank raises, the same exception type is raised here, naming the
    rank, with the worker's traceback as its cause; the other ranks are stopped.

    ``fn`` and ``args`` are sent to the new processes, so ``fn`` must be importable: defined
    in a module (a ``.py`` file), not in a notebook cell or as a lambda.
    """
    check_positive_int("world_size", world_size)
    check_positive_int("threads", threads)
    if not callable(fn):
        raise TypeError(f"fn must be a function, got {type(fn).__name__}")
    qualname = getattr(fn, "__qualname__", "")
    if getattr(fn, "__module__", None) == "__main__" or "<lambda>" in qualname or "<locals>" in qualname:
        raise TypeError(
            f"fn ({qualname or fn!r}) runs in other processes, so it must be importable by name: define it in a "
            "module (a .py file) and import it; functions defined in a notebook cell, lambdas and nested "
            "functions cannot be sent to a new process"
        )
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    if device == "cuda":
        available = torch.cuda.device_count()
        if world_size > available:
            raise ValueError(f"world_size = {world_size} needs one GPU per rank, but {available} are available")
    backend = backend or ("nccl" if device == "cuda" else "gloo")
    if device == "cpu" and backend == "nccl":
        raise ValueError("the nccl backend needs device='cuda'; use backend='gloo' on the CPU")
    if not dist.is_available():
        raise RuntimeError("this PyTorch build has no torch.distributed")

    job = pickle.dumps((fn, args))
    for attempt in range(3):
        results, errors, unfinished = _launch(job, world_size, backend, device, threads, timeout_s)
        # The free port can be taken by another program between our probe and rank 0's bind: try another.
        taken = any(stage == "join" and "address already in use" in str(error).lower() for _, error, stage in errors)
        if not (taken and attempt < 2):
            break
    if errors:
        raise min(errors, key=lambda e: e[0])[1]
    if unfinished:
        raise TimeoutError(
            f"ranks {unfinished} of {world_size} did not finish within {timeout_s:g} s (a rank waiting for a "
            "collective the others never called?)"
        )
    return results


def _launch(job: bytes, world_size: int, backend: str, device: str, threads: int, timeout_s: float):
    """Start the workers once; return (results, [(rank, error, stage)], ranks that never answered)."""
    context = _context()
    port = _free_port()
    processes, connections = [], []
    for rank in range(world_size):
        receive, send = context.Pipe(duplex=False)
        process = context.Process(
            target=_worker, daemon=True,
            args=(rank, world_size, port, backend, device, threads, timeout_s, job, send),
        )
        process.start()
        send.close()
        processes.append(process)
        connections.append(receive)

    results: list[Any] = [None] * world_size
    errors: list[tuple[int, BaseException, str]] = []
    waiting = dict(enumerate(connections))
    deadline, first_error = time.monotonic() + timeout_s, None
    try:
        while waiting:
            # Once a rank has failed, the others are probably stuck in a collective: give them a moment.
            limit = deadline if first_error is None else min(deadline, first_error + 5.0)
            ready = multiprocessing.connection.wait(list(waiting.values()), timeout=max(0.0, limit - time.monotonic()))
            if not ready:
                break
            for connection in ready:
                rank = next(r for r, c in waiting.items() if c is connection)
                del waiting[rank]
                try:
                    status, payload = pickle.loads(connection.recv_bytes())
                except EOFError:
                    processes[rank].join(5)
                    code = processes[rank].exitcode
                    status, payload = "error", ("builtins", "RuntimeError",
                                                f"the process exited (code {code}) without a result"
                                                + (": killed, out of memory?" if code == -9 else ""), "", "run")
                if status == "ok":
                    results[rank] = payload
                else:
                    errors.append((rank, _error(rank, world_size, payload[:4]), payload[4]))
                    first_error = first_error or time.monotonic()
    finally:
        for process in processes:
            if process.is_alive():
                process.terminate()
        for process in processes:
            process.join(5)
            if process.is_alive():
                process.kill()
                process.join()
        for connection in connections:
            connection.close()
    return results, errors, sorted(waiting)


# ----------------------------------------------------------------------------------------
# One attention call on W processes, from full tensors: exactness, bytes, memory


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
    _synchronize(device)
    return time.perf_counter()


def _sharded_call(method, q, k, v, keep, is_causal, layout, fused):
    if method == "ring":
        return ring_attention(q, k, v, key_padding_mask=keep, is_causal=is_causal, layout=layout)
    if method == "ulysses":
        return ulysses_attention(q, k, v, key_padding_mask=keep, is_causal=is_causal, layout=layout, fused=fused)
    mask = None if keep is None else keep[:, None, None, :]  # (B, 1, 1, L)
    return scaled_dot_product_attention(q, k, v, mask, is_causal=is_causal, fused=fused)  # one process, W = 1


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
        q, k, v: the whole sequence, ``(B, H, L, D)``, ``(B, H, L, D)``, ``(B, H, L, Dv)``.
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
        _check_shard(name, x)
    if k.shape != q.shape or v.shape[:3] != q.shape[:3]:
        raise ValueError(f"expected q, k (B, H, L, D) and v (B, H, L, Dv) of one sequence, got q {shape_str(q.shape)}, "
                         f"k {shape_str(k.shape)}, v {shape_str(v.shape)}")
    B, H, L, _ = q.shape
    sequence_positions(L, world_size, layout=layout)  # raises if the world size does not divide the sequence
    if method == "ulysses" and H % world_size:
        raise ValueError(f"ulysses splits the H = {H} heads over world_size = {world_size} ranks: H must be a multiple "
                         "of the world size")
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


# ----------------------------------------------------------------------------------------
# Pictures


def plot_ring_schedule(world_size: int, *, ax=None):
    """A grid: row = rank, column = step, each cell names (and colours) the K/V block that rank holds."""
    import matplotlib.pyplot as plt

    schedule = torch.tensor(ring_schedule(world_size))  # (W, W)
    if ax is None:
        _, ax = plt.subplots(figsize=(1.1 * world_size + 1.6, 0.7 * world_size + 1.0))
    ax.imshow(schedule.numpy(), cmap="tab10", vmin=0, vmax=9, alpha=0.55)
    for rank in range(world_size):
        for step in range(world_size):
            ax.text(step, rank, f"K/V {int(schedule[rank, step])}", ha="center", va="center", fontsize=9)
    ax.set_xticks(range(world_size), [f"step {s}" for s in range(world_size)])
    ax.set_yticks(range(world_size), [f"rank {r}" for r in range(world_size)])
    ax.set_title("which rank's K/V block each rank holds")
    return ax.figure


def plot_causal_layout(seq_len: int, world_size: int, *, layout: str = "zigzag", ax=None):
    """The causal (L, L) score matrix, each query-key pair coloured by the rank that computes it.

    White: blocks the ring skips (entirely in the future). Pale: computed on a diagonal
    block, then masked. The colour of a row is the rank that holds that query.
    """
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    positions = sequence_positions(seq_len, world_size, layout=layout)
    owner = torch.full((seq_len, seq_len), -1.0)  # (L, L): rank computing each pair, -1 = skipped
    masked = torch.zeros(seq_len, seq_len, dtype=torch.bool)  # (L, L): computed, then masked
    for rank in range(world_size):
        for source in ring_schedule(world_size)[rank]:
            for qs, ks, causal in _block_plan(positions[rank], positions[source], is_causal=True,
                                              max_run=_chunk_length(seq_len // world_size, layout)):
                rows, cols = positions[rank][qs], positions[source][ks]
                owner[rows[:, None], cols[None, :]] = rank
                if causal is not None:
                    masked[rows[:, None], cols[None, :]] = ~causal
    if ax is None:
        _, ax = plt.subplots(figsize=(4, 4))
    colours = plt.get_cmap("tab10")(range(world_size))
    image = torch.ones(seq_len, seq_len, 4)  # (L, L, RGBA), white
    for rank in range(world_size):
        image[owner == rank] = torch.tensor(colours[rank], dtype=torch.float32)
    image[masked, 3] = 0.25  # masked pairs: pale
    ax.imshow(image.numpy(), interpolation="nearest")
    ax.legend(handles=[Patch(color=colours[r], label=f"rank {r}") for r in range(world_size)], loc="upper right",
              fontsize=8, frameon=False)
    ax.set_xlabel("key position")
    ax.set_ylabel("query position")
    ax.set_title(f"{layout}, W={world_size}")
    return ax.figure
