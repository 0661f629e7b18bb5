"""Which tokens live on which rank: the contiguous and zig-zag layouts, the ring's schedule, and the blocks of scores a ring step computes.

A sequence of L tokens is split over W ranks, L / W tokens each (:func:`sequence_positions`);
:func:`shard_sequence` and :func:`gather_sequence` move whole tensors between the two views.
At step t of the ring, rank r holds the K/V block of rank ``(r - t) mod W``
(:func:`ring_schedule`). With a causal mask a ring step computes only the blocks of
(query run, key run) that hold an allowed pair (:func:`block_plan`), and :func:`causal_work`
counts what that leaves each rank to do: the reason for the zig-zag layout.

Taught in lesson 12 (attention across devices).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from .._checks import check_positive_int

__all__ = [
    "LAYOUTS",
    "sequence_positions",
    "shard_sequence",
    "gather_sequence",
    "ring_schedule",
    "check_layout_fits",
    "block_plan",
    "chunk_length",
    "causal_work",
]

LAYOUTS = ("contiguous", "zigzag")

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


def check_layout_fits(name: str, local_length: int, world_size: int, layout: str) -> None:
    """Raise ``ValueError`` (naming the function ``name``) unless ``layout`` can hold shards of ``local_length`` tokens."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if layout == "zigzag" and local_length % 2:
        raise ValueError(
            f"{name}: the zig-zag layout gives each rank two equal chunks, so each rank's shard must hold an even "
            f"number of tokens; got {local_length} per rank (sequence {local_length * world_size} on {world_size} "
            f"ranks). Pad the sequence to a multiple of {2 * world_size} and mask the padding, or use layout='contiguous'"
        )


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


def block_plan(
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


def chunk_length(local_length: int, layout: str) -> int:
    """Tokens per chunk of a rank's shard: half of it for zig-zag (two chunks), all of it otherwise."""
    return local_length // 2 if layout == "zigzag" else local_length


def causal_work(seq_len: int, world_size: int, *, layout: str = "zigzag", is_causal: bool = True) -> torch.Tensor:
    """Scores each rank computes at each ring step, per batch element and head: ``(W, W)`` int64.

    Entry ``[rank, step]`` counts the query-key pairs in the blocks
    :func:`~attn_course.distributed.ring.ring_attention` computes (a diagonal block counts
    whole: it is computed, then half of it masked). The ring's own
    :class:`~attn_course.distributed.exchange.CommunicationLog` records the same numbers while it runs.
    """
    positions = sequence_positions(seq_len, world_size, layout=layout)
    work = torch.zeros(world_size, world_size, dtype=torch.int64)  # (W, W)
    for rank in range(world_size):
        for step, source in enumerate(ring_schedule(world_size)[rank]):
            plan = block_plan(positions[rank], positions[source], is_causal=is_causal,
                              max_run=chunk_length(seq_len // world_size, layout))
            work[rank, step] = sum((qs.stop - qs.start) * (ks.stop - ks.start) for qs, ks, _ in plan)
    return work
