"""The exchanges between ranks, and the log that counts them: bytes sent, time waited, scores computed.

Every exchange of :mod:`attn_course.distributed` goes through the thin wrappers around
``torch.distributed`` below (:class:`RingExchange`, :func:`all_to_all`, :func:`all_gather`),
and every block of ring work reports itself (:func:`record`), so that inside
``with log_communication() as log:`` a rank's :class:`CommunicationLog` holds what it sent
and computed, event by event. "Bytes sent" is what this rank's own data puts on the wire: a
send's tensors; for an all-to-all the W - 1 chunks that leave the rank; for an all-gather the
rank's tensor once per other rank. Without a running process group everything runs as one
rank (W = 1), and nothing is sent.

Taught in lesson 12 (attention across devices).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist

__all__ = [
    "CommEvent",
    "WorkEvent",
    "CommunicationLog",
    "log_communication",
    "record",
    "synchronize",
    "timed",
    "group_rank_size",
    "RingExchange",
    "all_to_all",
    "all_gather",
]

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
    """Record every exchange and every block of work of :mod:`attn_course.distributed` in this process.

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


def synchronize(device: torch.device) -> None:
    """Wait for the GPU's queued work (a no-op on the CPU), so that a clock read after it means something."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def record(event: CommEvent | WorkEvent) -> None:
    """Add ``event`` to every log that is recording in this process."""
    for log in _ACTIVE_LOGS:
        (log.events if isinstance(event, CommEvent) else log.work).append(event)


def timed(device: torch.device) -> float:
    """A stopwatch that waits for the GPU before reading the clock, only while a log is recording."""
    if _ACTIVE_LOGS:
        synchronize(device)
    return time.perf_counter()


# ----------------------------------------------------------------------------------------
# The wrappers: every exchange of the package goes through one of these


def _nbytes(tensors: Sequence[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def group_rank_size(group) -> tuple[int, int]:
    """(rank, world size) in ``group``; (0, 1) when no process group is running."""
    if not (dist.is_available() and dist.is_initialized()):
        if group is not None:
            raise RuntimeError("a process group was passed but torch.distributed is not initialised")
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _global_rank(group, rank: int) -> int:
    return rank if group is None or group is dist.GroupMember.WORLD else dist.get_global_rank(group, rank)


class RingExchange:
    """Send tensors to the next rank and receive the same shapes from the previous one, asynchronously."""

    def __init__(self, tensors: Sequence[torch.Tensor], group, *, what: str, phase: str, step: int) -> None:
        rank, world_size = group_rank_size(group)
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
        synchronize(self.sent[0].device)
        what, phase, step = self.meta
        record(CommEvent("send/recv", what, phase, step, _nbytes(self.sent), time.perf_counter() - start))
        return self.received


def all_to_all(x: torch.Tensor, group, *, what: str, phase: str) -> torch.Tensor:
    """``x`` ``(W, ...)``: chunk ``w`` goes to rank ``w``; returns ``(W, ...)`` with chunk ``w`` from rank ``w``."""
    _, world_size = group_rank_size(group)
    x = x.contiguous()
    if world_size == 1:
        return x.clone()
    out = torch.empty_like(x)
    start = time.perf_counter()
    dist.all_to_all_single(out, x, group=group)
    synchronize(x.device)
    sent = _nbytes([x]) * (world_size - 1) // world_size  # the chunk for this rank itself stays here
    record(CommEvent("all-to-all", what, phase, 0, sent, time.perf_counter() - start))
    return out


def all_gather(x: torch.Tensor, group, *, what: str, phase: str) -> list[torch.Tensor]:
    _, world_size = group_rank_size(group)
    x = x.contiguous()
    if world_size == 1:
        return [x]
    out = [torch.empty_like(x) for _ in range(world_size)]
    start = time.perf_counter()
    dist.all_gather(out, x, group=group)
    synchronize(x.device)
    record(CommEvent("all-gather", what, phase, 0, _nbytes([x]) * (world_size - 1), time.perf_counter() - start))
    return out
