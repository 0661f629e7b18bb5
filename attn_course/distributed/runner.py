"""Running W processes on this machine, joined in a ``torch.distributed`` process group.

:func:`run_distributed` starts W processes (gloo on the CPU, NCCL with one GPU per rank),
runs ``fn(rank, world_size, *args)`` in each and returns the results in rank order; an error
in any rank is raised here, naming the rank, with its traceback. A function run in another
process must be importable: define it in a module, not in a notebook cell.
:func:`rank_summary` is the smallest useful worker: one ``all_reduce``. Only the loopback
interface (``127.0.0.1``) is used.

Taught in lesson 12 (attention across devices).
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import pickle
import socket
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from .._checks import check_positive_int

__all__ = ["RemoteTraceback", "rank_summary", "run_distributed"]


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


