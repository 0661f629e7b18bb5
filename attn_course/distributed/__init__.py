"""Attention across processes: ring attention and head-parallel (Ulysses) attention on ``torch.distributed``.

A long sequence does not fit on one device (lesson 04), so it is split along the sequence
axis: each of the W processes ("ranks") holds L / W of the queries, keys and values. Two
ways to still compute exact attention over the whole sequence:

* :func:`ring_attention` (:mod:`.ring`) -- every rank keeps its queries; the key/value blocks
  travel around a ring of ranks and are merged with lesson 07's online softmax
  (:func:`ring_step`), the backward pass sends them around again (:func:`ring_step_backward`).
  With a causal mask the **zig-zag** layout (:func:`sequence_positions`, :mod:`.layout`) gives
  every rank the same work.
* :func:`ulysses_attention` (:mod:`.ulysses`) -- one all-to-all turns "all heads of L / W
  tokens" into "H / W heads of all L tokens", each rank runs ordinary attention for its heads,
  and a second all-to-all turns the output back.

Both accept grouped-query attention (lesson 11): k and v with ``Hkv`` heads, ``Hkv`` dividing
``H``. The ring then moves only the ``Hkv`` K/V heads; Ulysses moves queries, keys, values and
outputs (:func:`ulysses_kv_heads` says how many K/V heads it must send).

Both are exact: they equal single-process attention up to rounding (tests: float64, 1e-10,
outputs and gradients, world sizes 1-5, causal, padded).

Around them, one module per concept, each read top to bottom:

* :mod:`.layout` -- which tokens live on which rank, the ring's schedule, the blocks of
  scores a ring step computes (:func:`causal_work` counts them);
* :mod:`.exchange` -- the wrappers around ``torch.distributed`` every exchange goes through,
  and the :class:`CommunicationLog` they fill (:func:`log_communication`): bytes sent, time
  waited, scores computed;
* :mod:`.runner` -- :func:`run_distributed` starts W processes on this machine (gloo on CPU,
  NCCL on GPUs) and returns their results; :func:`rank_summary` is the smallest worker;
* :mod:`.sharded` -- :func:`run_sharded_attention` (and ``_batch``) runs one attention
  method on W processes from full tensors and gathers the output, the gradients, each rank's
  log and its measured peak memory;
* :mod:`.pictures` -- :func:`plot_ring_schedule`, :func:`plot_causal_layout`.

Shapes: each rank passes its shard q ``(B, H, L/W, D)``, k ``(B, Hkv, L/W, D)``, v ``(B, Hkv,
L/W, Dv)`` (``Hkv = H`` for multi-head attention) and optionally ``key_padding_mask`` ``(B, L/W)`` (bool, True = a real token that
may be attended to, as everywhere in the course) and gets its shard of the output ``(B, H,
L/W, Dv)``. Every rank must pass the same shapes and options.

Taught in lesson 12 (attention across devices).
"""

from __future__ import annotations

from .exchange import CommEvent, CommunicationLog, WorkEvent, log_communication
from .layout import LAYOUTS, causal_work, gather_sequence, ring_schedule, sequence_positions, shard_sequence
from .pictures import plot_causal_layout, plot_ring_schedule
from .ring import ring_attention, ring_step, ring_step_backward
from .runner import RemoteTraceback, rank_summary, run_distributed
from .sharded import METHODS, ShardedAttentionRun, run_sharded_attention, run_sharded_attention_batch
from .ulysses import ulysses_attention, ulysses_kv_heads

__all__ = [
    "LAYOUTS",
    "METHODS",
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
    "ulysses_kv_heads",
    "RemoteTraceback",
    "rank_summary",
    "run_distributed",
    "ShardedAttentionRun",
    "run_sharded_attention",
    "run_sharded_attention_batch",
    "plot_ring_schedule",
    "plot_causal_layout",
]
