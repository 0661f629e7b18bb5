"""Benchmarks that print measured numbers: times, peak memory, ratios, and the machine's matmul rate.

* ``attn-course bench mha``: ``MultiHeadAttention`` against ``nn.MultiheadAttention``.
* ``attn-course bench peers``: the library against pure-PyTorch peers from PyPI that do the same
  job (the ``bench`` extra: linear-attention-transformer, memory-efficient-attention-pytorch,
  local-attention), each peer's maths matched to ours and its difference from ours measured
  (:func:`bench_peers`; what each peer computes is written above :data:`PEER_PACKAGES`).
* ``attn-course bench attention``: time and peak memory against sequence length for dense
  explicit attention, PyTorch's fused kernel, block-local (:mod:`attn_course.sparse`), linear
  (:mod:`attn_course.linear`) and chunked (:mod:`attn_course.chunked`) attention, as a table,
  JSON and a plot, with the course's performance targets checked as ratios measured in the
  same run (:func:`bench_attention`, :func:`attention_targets`).

Every figure is measured in the run that prints it; nothing is typed in. The measuring tools
themselves (time, largest tensor, saved tensors, peak memory) are in :mod:`attn_course.measure`.

* **Time**: forward pass under ``torch.no_grad()``, median of several rounds; within a
  round the variants take turns (in a rotating order), so a burst of load from other
  programs hits all of them rather than one.
* **Peak memory** is measured, not computed. On CPU each point runs in a fresh child
  process (forked from a clean server process that has only imported torch): the child
  builds the inputs, resets the kernel's peak-RSS counter (``/proc/self/clear_refs``), runs
  the call once and reads ``VmHWM``; the figure is that peak minus the RSS just before the
  call, minus the same figure for a child that skips the call (the noise floor). Where the
  counter cannot be reset (not Linux) ``ru_maxrss`` before and after is used instead. On
  CUDA it is ``torch.cuda.max_memory_allocated`` minus the memory allocated before the call.
* **Throughput**: a FLOP count per variant (:func:`attention_flops`) over the time, also as
  a fraction of the rate of one 2048 x 2048 matmul timed in the same interleaved rounds
  (the machine's practical peak, measured under the same load).

Taught in lesson 04 (the cost of attention); lessons 05-07 use it for their variants.
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import math
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn as nn

from ._checks import check_positive_int
from .attention import scaled_dot_product_attention
from .chunked import chunked_attention
from .linear import linear_attention
from .measure import fresh_page_bytes, peak_memory_bytes, synchronize, time_call
from .multihead import MultiHeadAttention
from .sparse import sparse_attention

# The measuring tools (time_call, synchronize, largest_tensor_bytes, saved_tensor_bytes, peak memory)
# live in attn_course.measure; this module builds the benchmarks from them.
__all__ = [
    "matmul_gflops",
    "bench_mha",
    "VARIANTS",
    "AttentionBenchConfig",
    "attention_variant",
    "attention_flops",
    "measure_peak_memory",
    "interleaved_times",
    "bench_attention",
    "attention_targets",
    "format_attention_table",
    "plot_attention_bench",
    "report_attention",
    "BENCH_EXTRA",
    "MissingPeersError",
    "load_peers",
    "PeersBenchConfig",
    "bench_peers",
    "peers_targets",
    "format_peers_table",
    "report_peers",
]


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


# ----------------------------------------------------------------------------------------
# Attention variants against sequence length (lesson 04)

VARIANTS = ("dense", "fused", "block_local", "linear", "chunked")
# Variants whose cost grows with N^2: skipped above ``max_quadratic_length``.
QUADRATIC_VARIANTS = ("dense", "fused", "chunked")
LABELS = {
    "dense": "dense explicit",
    "fused": "PyTorch fused",
    "block_local": "block-local",
    "linear": "linear (elu+1)",
    "chunked": "chunked",
}
_DTYPES = ("float32", "float64", "float16", "bfloat16")


@dataclasses.dataclass(frozen=True)
class AttentionBenchConfig:
    """What :func:`bench_attention` measures. The defaults are the course's target set-up.

    Inputs are q, k, v of shape ``(batch, heads, N, head_dim)`` for each N in ``lengths``.
    ``block_size`` is the block-local block, ``chunk_size`` the chunked attention's query
    and key chunk. Dense, fused and chunked attention are skipped for N above
    ``max_quadratic_length`` (dense explicit at N=16384 would need about 25 GB here).
    """

    lengths: tuple[int, ...] = (1024, 2048, 4096, 8192, 16384)
    variants: tuple[str, ...] = VARIANTS
    batch: int = 1
    heads: int = 8
    head_dim: int = 64
    dtype: str = "float32"
    block_size: int = 128
    chunk_size: int = 1024
    max_quadratic_length: int = 8192
    rounds: int = 3
    measure_memory: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "lengths", tuple(self.lengths))
        object.__setattr__(self, "variants", tuple(self.variants))
        if not self.lengths:
            raise ValueError("lengths is empty: give at least one sequence length")
        for n in self.lengths:
            check_positive_int("each length", n)
        unknown = [v for v in self.variants if v not in VARIANTS]
        if unknown or not self.variants:
            raise ValueError(f"variants must be a non-empty subset of {VARIANTS}, got {self.variants}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {_DTYPES}, got {self.dtype!r}")
        for name in ("batch", "heads", "head_dim", "block_size", "chunk_size", "max_quadratic_length", "rounds"):
            check_positive_int(name, getattr(self, name))

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)


def attention_variant(name: str, config: AttentionBenchConfig) -> Callable[..., torch.Tensor]:
    """The function ``f(q, k, v) -> out`` that the benchmark times for variant ``name``."""
    if name == "dense":
        return lambda q, k, v: scaled_dot_product_attention(q, k, v, fused=False)
    if name == "fused":
        return lambda q, k, v: scaled_dot_product_attention(q, k, v, fused=True)
    if name == "block_local":
        return lambda q, k, v: sparse_attention(q, k, v, pattern="block", size=config.block_size)
    if name == "linear":
        return lambda q, k, v: linear_attention(q, k, v, feature_map="elu")
    if name == "chunked":
        size = config.chunk_size
        return lambda q, k, v: chunked_attention(q, k, v, query_chunk_size=size, key_chunk_size=size)
    raise ValueError(f"unknown variant {name!r}; expected one of {VARIANTS}")


def attention_flops(name: str, length: int, config: AttentionBenchConfig) -> float:
    """Multiply-add FLOPs (2 per multiply-add) of one forward pass; exp and softmax ignored.

    Dense, fused and chunked: ``QK^T`` and ``PV``, ``4 B H N^2 D``. Block-local: the same
    per block, ``4 B H N_padded b D``. Linear (``M = D`` features): ``phi(K)^T V`` and
    ``phi(Q) S``, ``4 B H N D^2``, plus the normaliser ``4 B H N D``.
    """
    bh, d = config.batch * config.heads, config.head_dim
    if name in QUADRATIC_VARIANTS:
        return 4.0 * bh * length * length * d
    if name == "block_local":
        block = min(config.block_size, length)
        return 4.0 * bh * math.ceil(length / block) * block * block * d
    if name == "linear":
        return 4.0 * bh * length * d * (d + 1)
    raise ValueError(f"unknown variant {name!r}; expected one of {VARIANTS}")


def _inputs(config: AttentionBenchConfig, length: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """Seeded q, k, v ``(B, H, N, D)``, made on CPU so every device sees the same numbers."""
    generator = torch.Generator().manual_seed(config.seed + length)
    shape = (config.batch, config.heads, length, config.head_dim)
    return tuple(torch.randn(shape, generator=generator).to(device=device, dtype=config.torch_dtype) for _ in range(3))


def _measure_in_this_process(request: dict) -> dict:
    """One measurement in a fresh process: build inputs, run the call once, report the bytes it added."""
    if request.get("kind") == "peers":
        return _measure_peer_in_this_process(request)
    try:
        torch.set_num_threads(request["threads"])
        config = AttentionBenchConfig(**request["config"])
        name, length = request["name"], request["length"]
        q, k, v = _inputs(config, length, torch.device("cpu"))
        with torch.no_grad():
            fn = attention_variant(name, config) if name != "none" else None
            if fn is not None:
                # Warm the code path on a tiny input, so one-time set-up (thread pools, lazily
                # loaded kernels) is not counted as the attention's memory.
                fn(*(x[..., : min(length, 64), :].clone() for x in (q, k, v)))
            measured = peak_memory_bytes((lambda: fn(q, k, v)) if fn is not None else (lambda: None))
        return {**measured, "method": "child process " + measured["method"]}
    except Exception as exc:  # reported to the parent, which prints it
        return {"bytes": None, "method": "child process", "error": f"{type(exc).__name__}: {exc}"}


def _memory_server() -> None:
    """The measuring process: reads one JSON request per line, answers one JSON line each.

    It imports torch once and never runs a torch operation itself, so it can ``fork`` a
    clean child per request (no thread pool to break, no freed memory in the heap); the
    child measures and exits. Without ``fork`` (Windows) it measures in itself, and the
    parent starts a new server for every request. It ends when its stdin closes (the parent
    exited), so it ignores Ctrl-C: an interrupted or restarted kernel must not print its traceback.
    """
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    for line in sys.stdin:
        request = json.loads(line)
        if not hasattr(os, "fork"):
            print(json.dumps(_measure_in_this_process(request)), flush=True)
            continue
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child
            os.close(read_end)
            try:
                os.write(write_end, json.dumps(_measure_in_this_process(request)).encode())
            finally:
                os._exit(0)
        os.close(write_end)
        chunks = []
        while chunk := os.read(read_end, 65536):
            chunks.append(chunk)
        os.close(read_end)
        _, status = os.waitpid(pid, 0)
        if chunks:
            answer = json.loads(b"".join(chunks))
        else:
            killed = os.WIFSIGNALED(status) and os.WTERMSIG(status) == 9
            answer = {"bytes": None, "method": "child process",
                      "error": f"the measuring child died (status {status})" + (": out of memory?" if killed else "")}
        print(json.dumps(answer), flush=True)


class _MemoryServer:
    """The parent's handle on :func:`_memory_server`, started on first use and reused."""

    def __init__(self) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-c", "from attn_course.bench import _memory_server; _memory_server()"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )

    def measure(self, request: dict) -> dict:
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        line = self.process.stdout.readline()
        if not line:
            return {"bytes": None, "method": "child process", "error": "the memory server exited"}
        return json.loads(line)

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.close()
            self.process.wait(timeout=60)


_SERVER: _MemoryServer | None = None


def _memory_server_handle() -> _MemoryServer:
    global _SERVER
    if _SERVER is None or _SERVER.process.poll() is not None or not hasattr(os, "fork"):
        if _SERVER is not None:
            _SERVER.close()
        _SERVER = _MemoryServer()
        atexit.register(_SERVER.close)
    return _SERVER


def measure_peak_memory(
    name: str, length: int, config: AttentionBenchConfig, *, device: torch.device | str = "cpu"
) -> dict[str, object]:
    """Measure the extra peak memory of one forward call of variant ``name`` at sequence ``length``.

    ``name="none"`` measures the same thing without the call (the noise floor). Returns
    ``{"bytes": int | None, "method": str, "error": str | None}``; see the module docstring
    for the method on each device. MPS has no peak counter: ``bytes`` is None there.
    """
    device = torch.device(device)
    if name != "none":
        attention_variant(name, config)  # unknown names fail here, with the message
    if device.type != "cpu":  # the device's allocator counts for itself: measure here
        q, k, v = _inputs(config, length, device)
        fn = attention_variant(name, config) if name != "none" else None
        with torch.no_grad():
            if fn is not None:
                fn(q[..., :64, :], k[..., :64, :], v[..., :64, :])
            return peak_memory_bytes((lambda: fn(q, k, v)) if fn is not None else (lambda: None), device=device)
    request = {"name": name, "length": length, "config": dataclasses.asdict(config), "threads": torch.get_num_threads()}
    return _memory_server_handle().measure(request)


def interleaved_times(
    fns: dict[str, Callable[[], object]], *, device: torch.device | str, rounds: int,
    first: dict[str, float] | None = None, fresh_bytes: dict[str, list[float]] | None = None,
) -> dict[str, list[float]]:
    """Seconds per call of each function, one sample per round, measured in interleaved rounds.

    Every round times each function once, in a rotating order, so a burst of load from another
    program hits all of them alike; compare medians, and read the spread of the samples as how
    much the machine moved while they were taken. The first call of each warms up and sets how
    many calls make one sample (about 50 ms); pass ``first`` (seconds of a call already made) to
    skip it. Pass a dict as ``fresh_bytes`` to have it filled, on the CPU, with each function's
    fresh pages per call in every round (bytes: see :func:`attn_course.measure.fresh_page_bytes`),
    counted while the calls were timed.
    """
    device = torch.device(device)
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds}")
    samples: dict[str, list[float]] = {name: [] for name in fns}
    if fresh_bytes is not None:
        fresh_bytes.update({name: [] for name in fns})
    repeats = {}
    for name, fn in fns.items():
        if first is not None and name in first:
            seconds = first[name]
        else:
            start = time.perf_counter()
            fn()
            synchronize(device)
            seconds = time.perf_counter() - start
        repeats[name] = max(1, min(50, int(0.05 / max(seconds, 1e-9))))  # about 50 ms per sample
        if seconds > 1.0:
            samples[name].append(seconds)  # a call this long is its own warm-up: do not pay for it twice
    names = list(fns)
    counting = fresh_bytes is not None and device.type == "cpu"
    for round_index in range(rounds):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:  # a rotating order, so no variant always goes first
            if len(samples[name]) < rounds:
                def sample(name: str = name) -> None:
                    samples[name].append(time_call(fns[name], device=device, warmup=0, repeats=repeats[name]))

                page_bytes = fresh_page_bytes(sample) if counting else sample()  # None: not counted
                if page_bytes is not None:
                    fresh_bytes[name].append(page_bytes / repeats[name])
    return samples


def _interleaved_times(
    fns: dict[str, Callable[[], object]], *, device: torch.device, rounds: int, first: dict[str, float] | None = None
) -> dict[str, float]:
    """Median seconds per call of each function (see :func:`interleaved_times`)."""
    samples = interleaved_times(fns, device=device, rounds=rounds, first=first)
    return {name: statistics.median(values) for name, values in samples.items()}


def bench_attention(
    config: AttentionBenchConfig | None = None,
    *,
    device: torch.device | str = "cpu",
    matmul_rate: float | None = None,
    log: Callable[[str], None] | None = None,
) -> dict[str, object]:
    """Time (and measure the peak memory of) every variant at every length; return a JSON-able dict.

    Keys: ``device``, ``torch``, ``threads``, ``config``, ``matmul_gflops`` (the median rate),
    ``memory_method``, ``memory_baseline_bytes``, ``points`` (one dict per variant and length:
    ``time_s`` (the median round), ``time_range_s`` (the fastest and slowest round),
    ``fresh_bytes`` (fresh pages per call while timed, the median round; on the CPU), ``flops``,
    ``gflops``, ``matmul_gflops``, ``fraction_of_matmul``,
    ``peak_bytes``) and ``targets`` (see :func:`attention_targets`). The matmul rate is that
    of a 2048 x 2048 matmul timed in the same interleaved rounds as each length's variants;
    pass ``matmul_rate`` (GFLOP/s) to use a fixed figure instead.
    """
    config = AttentionBenchConfig() if config is None else config
    if not isinstance(config, AttentionBenchConfig):
        raise TypeError(f"config must be an AttentionBenchConfig, got {type(config).__name__}")
    device = torch.device(device)
    say = log or (lambda message: None)
    # The reference matmul is timed inside the same interleaved rounds as the attention
    # variants, so that a change in machine load between lengths hits both.
    size = 2048
    a = torch.randn(size, size, device=device, dtype=config.torch_dtype)
    b = torch.randn(size, size, device=device, dtype=config.torch_dtype)
    rates: list[float] = []
    # Run every code path once on a tiny input first: the first call in a process pays for
    # one-time set-up (thread pools, lazily loaded kernels) that is not attention's cost.
    tiny = _inputs(config, min(config.lengths[0], 64), device)
    with torch.no_grad():
        for name in config.variants:
            attention_variant(name, config)(*tiny)
    points: list[dict[str, object]] = []
    for length in config.lengths:
        names = [
            name for name in config.variants
            if name not in QUADRATIC_VARIANTS or length <= config.max_quadratic_length
        ]
        if not names:
            continue
        say(f"timing N={length}: {', '.join(names)}")
        q, k, v = _inputs(config, length, device)
        with torch.no_grad():
            fns = {name: (lambda f=attention_variant(name, config): f(q, k, v)) for name in names}
            if matmul_rate is None:
                fns["matmul"] = lambda: a @ b
            fresh_per_round: dict[str, list[float]] = {}
            samples = interleaved_times(fns, device=device, rounds=config.rounds, fresh_bytes=fresh_per_round)
        # The median over the rounds of the fresh pages per call, counted while they were timed.
        fresh = {name: statistics.median(fresh_per_round[name]) if fresh_per_round.get(name) else None
                 for name in names}
        times = {name: statistics.median(values) for name, values in samples.items()}
        del q, k, v, fns
        rate = matmul_rate if matmul_rate is not None else 2 * size**3 / times["matmul"] / 1e9
        rates.append(rate)
        for name in names:
            flops = attention_flops(name, length, config)
            gflops = flops / times[name] / 1e9
            points.append({
                "variant": name,
                "length": length,
                "time_s": times[name],
                "time_range_s": [min(samples[name]), max(samples[name])],  # fastest and slowest round
                "fresh_bytes": fresh[name],  # fresh pages per call while timed, median round (None off the CPU)
                "flops": flops,
                "gflops": gflops,
                "matmul_gflops": rate,
                "fraction_of_matmul": gflops / rate,
                "peak_bytes": None,
            })
    del a, b
    memory_method, baseline = None, None
    if config.measure_memory:
        if device.type == "cpu":
            floor = measure_peak_memory("none", config.lengths[0], config, device=device)
            baseline = floor["bytes"] or 0
        for point in points:
            say(f"peak memory {point['variant']} N={point['length']}")
            measured = measure_peak_memory(point["variant"], point["length"], config, device=device)
            memory_method = measured["method"]
            if measured["bytes"] is not None:
                point["peak_bytes"] = max(0, measured["bytes"] - (baseline or 0))
            else:
                point["memory_error"] = measured["error"]
    results: dict[str, object] = {
        "device": str(device),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "config": dataclasses.asdict(config),
        "matmul_gflops": statistics.median(rates),
        "memory_method": memory_method,
        "memory_baseline_bytes": baseline,
        "points": points,
    }
    results["targets"] = attention_targets(results)
    return results


def _point(results: dict, variant: str, length: int) -> dict | None:
    for point in results["points"]:
        if point["variant"] == variant and point["length"] == length:
            return point
    return None


def _ratio(results: dict, key: str, top: tuple[str, int], bottom: tuple[str, int]) -> float | None:
    a, b = _point(results, *top), _point(results, *bottom)
    if a is None or b is None or a.get(key) is None or not b.get(key):
        return None
    return a[key] / b[key]


def attention_targets(results: dict) -> list[dict[str, object]]:
    """The course's performance targets, as ratios from one run; ``passed`` is None if not measured.

    * chunked peak memory at N=8192 <= 1/8 of dense explicit's;
    * chunked time at N=8192 <= 1.5x dense explicit's;
    * linear attention t(16384) / t(1024) <= 24 (linear growth would be 16);
    * dense explicit time / block-local time at N=8192 >= 5.
    """
    block = results["config"]["block_size"]
    specs = [
        ("chunked peak memory / dense explicit, N=8192", "peak_bytes", ("chunked", 8192), ("dense", 8192), "<=", 1 / 8),
        ("chunked time / dense explicit, N=8192", "time_s", ("chunked", 8192), ("dense", 8192), "<=", 1.5),
        ("linear time t(16384) / t(1024)", "time_s", ("linear", 16384), ("linear", 1024), "<=", 24.0),
        (f"dense explicit time / block-local (block {block}), N=8192", "time_s", ("dense", 8192),
         ("block_local", 8192), ">=", 5.0),
    ]
    targets = []
    for text, key, top, bottom, op, limit in specs:
        value = _ratio(results, key, top, bottom)
        passed = None if value is None else (value <= limit if op == "<=" else value >= limit)
        targets.append({"target": text, "value": value, "op": op, "limit": limit, "passed": passed})
    return targets


def _megabytes(value: object) -> str:
    return "-" if value is None else f"{value / 2**20:.1f}"


def format_attention_table(results: dict) -> str:
    """The measured table (one row per variant and length), the throughput summary and the targets."""
    cfg = results["config"]
    lines = [
        f"attention forward, B={cfg['batch']} H={cfg['heads']} D={cfg['head_dim']} {cfg['dtype']} on "
        f"{results['device']} ({results['threads']} threads); 2048 x 2048 matmul {results['matmul_gflops']:.1f} GFLOP/s "
        "(median; each row uses the rate timed alongside it)",
        f"peak memory: {results['memory_method'] or 'not measured'}"
        + (f"; noise floor {_megabytes(results['memory_baseline_bytes'])} MiB subtracted"
           if results["memory_baseline_bytes"] is not None else ""),
        "",
        f"{'N':>6}  {'variant':<16}{'time ms':>10}{'peak MiB':>10}{'GFLOP/s':>9}{'of matmul':>11}",
    ]
    for point in results["points"]:
        lines.append(
            f"{point['length']:>6}  {LABELS[point['variant']]:<16}{point['time_s'] * 1e3:>10.2f}"
            f"{_megabytes(point['peak_bytes']):>10}{point['gflops']:>9.2f}{point['fraction_of_matmul']:>11.3f}"
        )
    lines += ["", "targets (ratios measured in this run):"]
    for target in results["targets"]:
        verdict = {True: "PASS", False: "FAIL", None: "n/a (not measured)"}[target["passed"]]
        value = "-" if target["value"] is None else f"{target['value']:.3f}"
        lines.append(f"  {target['target']}: {value} (target {target['op']} {target['limit']:.3g})  {verdict}")
    largest = max(p["length"] for p in results["points"])
    lines.append(f"throughput as a fraction of the matmul rate, at each variant's largest N (up to {largest}):")
    for variant in dict.fromkeys(p["variant"] for p in results["points"]):
        point = max((p for p in results["points"] if p["variant"] == variant), key=lambda p: p["length"])
        lines.append(f"  {LABELS[variant]:<16} N={point['length']:<6} {point['fraction_of_matmul']:.3f}")
    return "\n".join(lines)


def plot_attention_bench(results: dict, *, path: str | os.PathLike | None = None):
    """Time and peak memory against N, log-log, one line per variant; saved to ``path`` if given."""
    from matplotlib.figure import Figure

    figure = Figure(figsize=(10, 4), layout="constrained")
    time_axes, memory_axes = figure.subplots(1, 2)
    for variant in dict.fromkeys(p["variant"] for p in results["points"]):
        points = [p for p in results["points"] if p["variant"] == variant]
        lengths = [p["length"] for p in points]
        line, = time_axes.plot(lengths, [p["time_s"] * 1e3 for p in points], marker="o", label=LABELS[variant])
        if all("time_range_s" in p for p in points):  # the fastest and slowest round, as a bar around the median
            low = [(p["time_s"] - p["time_range_s"][0]) * 1e3 for p in points]
            high = [(p["time_range_s"][1] - p["time_s"]) * 1e3 for p in points]
            time_axes.errorbar(lengths, [p["time_s"] * 1e3 for p in points], yerr=[low, high], fmt="none",
                               ecolor=line.get_color(), capsize=3, linewidth=1)
        measured = [(p["length"], p["peak_bytes"] / 2**20) for p in points if p["peak_bytes"]]
        if measured:
            memory_axes.plot(*zip(*measured), marker="o", label=LABELS[variant])
    cfg = results["config"]
    for axes, ylabel in ((time_axes, "forward time (ms)"), (memory_axes, "peak memory added (MiB)")):
        axes.set_xscale("log", base=2)
        axes.set_yscale("log")
        axes.set_xlabel("sequence length N")
        axes.set_ylabel(ylabel)
        axes.grid(True, which="major", alpha=0.3)
    if any("time_range_s" in p for p in results["points"]):
        time_axes.set_title("median round; bar: fastest to slowest round", fontsize="small")
    time_axes.legend(fontsize="small")
    if memory_axes.lines:
        memory_axes.legend(fontsize="small")
    else:
        memory_axes.text(0.5, 0.5, "memory not measured", ha="center", va="center", transform=memory_axes.transAxes)
    figure.suptitle(
        f"attention cost on {results['device']}: B={cfg['batch']} H={cfg['heads']} D={cfg['head_dim']} {cfg['dtype']}"
    )
    if path is not None:
        figure.savefig(path, dpi=110)
    return figure


def report_attention(
    config: AttentionBenchConfig | None = None,
    *,
    device: torch.device | str = "cpu",
    matmul_rate: float | None = None,
    json_path: str | os.PathLike | None = None,
    plot_path: str | os.PathLike | None = None,
) -> dict[str, object]:
    """Run :func:`bench_attention`, print its table and targets, and write the JSON / PNG if asked."""
    results = bench_attention(
        config, device=device, matmul_rate=matmul_rate, log=lambda message: print(f"  .. {message}", flush=True)
    )
    print(format_attention_table(results), flush=True)
    if json_path is not None:
        Path(json_path).write_text(json.dumps(results, indent=2))
        print(f"wrote {json_path}")
    if plot_path is not None:
        plot_attention_bench(results, path=plot_path)
        print(f"wrote {plot_path}")
    return results


# ----------------------------------------------------------------------------------------
# The library against pure-PyTorch peers from PyPI that do the same job (`attn-course bench peers`)
#
# What each peer computes was read from its source (versions pinned by the `bench` extra) and is
# matched here so that every row of a comparison computes the same function of the same inputs;
# each peer's max |difference| from ours is measured and printed beside its time.
#
# * linear-attention-transformer's ``causal_linear_attn(q, k, v, bucket_size=b, eps=e)``: features
#   ``phi_q(q) = softmax(q) / sqrt(D)`` (over D) and ``phi_k(k) = exp(k)``, output
#   ``phi_q(q_i)^T S / max(phi_q(q_i)^T z, e)``. With ``bucket_size=1`` the sums ``S, z`` run over
#   ``j <= i``: exact causal linear attention (its prefix-sum form, one (D, Dv) state per position).
#   With ``bucket_size > 1`` (its default 64) they run over the *earlier buckets only*: a query
#   never sees its own bucket, so it is a different, cheaper function (its row is labelled so and
#   its difference from ours shows it; it runs with its default eps, which gives the first bucket
#   zeros). Ours computes the same features by being handed
#   ``q' = log(softmax(q) / sqrt(D))`` and ``feature_map=torch.exp``, with ``eps=0`` on both sides
#   (the denominators are sums of exponentials, never near 0 here).
# * memory-efficient-attention-pytorch's ``memory_efficient_attention`` (query chunks of 512, key
#   chunks of 1024, each chunk checkpointed when a gradient is needed; ``+ 1e-8`` in the
#   denominator) and ``FlashAttentionFunction`` (the FlashAttention recurrence with its own
#   recomputing backward, same chunks): exact softmax attention, scale 1/sqrt(D), causal
#   top-left aligned -- the same as ``chunked_attention`` and ``F.scaled_dot_product_attention``.
# * local-attention's ``LocalAttention(window_size=b, causal=True, look_backward=0,
#   use_rotary_pos_emb=False)``: each query attends to the keys of its own block, j <= i -- ours is
#   ``sparse_attention(pattern="block", size=b, is_causal=True)``. With ``look_backward=1,
#   exact_windowsize=True`` it is the causal sliding window ``i - b <= j <= i``, ours
#   ``pattern="sliding"``.
# * ``MultiHeadAttention`` against ``nn.MultiheadAttention`` holding the same weights
#   (``MultiHeadAttention.from_torch``), batch-first, no mask, ``need_weights=False``.

BENCH_EXTRA = "pip install 'attn-course[bench]'"
# distribution name -> module name, as pinned in pyproject.toml's `bench` extra
PEER_PACKAGES = {
    "linear-attention-transformer": "linear_attention_transformer",
    "memory-efficient-attention-pytorch": "memory_efficient_attention_pytorch",
    "local-attention": "local_attention",
}
PEER_WORKS = ("linear", "exact", "local", "mha")


class MissingPeersError(ImportError):
    """A peer package of ``attn-course bench peers`` is not installed; the message names the extra."""


def load_peers() -> dict[str, object]:
    """Import the three peer packages; return the functions compared. Raises :class:`MissingPeersError`."""
    import importlib

    modules, missing = {}, []
    for distribution, module in PEER_PACKAGES.items():
        try:
            modules[module] = importlib.import_module(module)
        except ImportError:
            missing.append(distribution)
    if missing:
        raise MissingPeersError(f"missing peer package(s) {', '.join(missing)}: {BENCH_EXTRA}")
    lat = importlib.import_module("linear_attention_transformer.linear_attention_transformer")
    mea = importlib.import_module("memory_efficient_attention_pytorch.memory_efficient_attention")
    flash = importlib.import_module("memory_efficient_attention_pytorch.flash_attention")
    return {
        "causal_linear_attn": lat.causal_linear_attn,
        "memory_efficient_attention": mea.memory_efficient_attention,
        "FlashAttentionFunction": flash.FlashAttentionFunction,
        "LocalAttention": modules["local_attention"].LocalAttention,
    }


@dataclasses.dataclass(frozen=True)
class PeersBenchConfig:
    """What :func:`bench_peers` measures; the defaults are issue 22's table (B=1, H=8, D=64, fp32).

    ``linear_lengths``: causal linear attention; ``exact_lengths``: exact attention (non-causal
    and causal, forward and forward+backward); ``local_length``: block-local / sliding window of
    ``block_size``; the ``mha_*`` fields: ``MultiHeadAttention`` forward+backward.
    ``linear_bucket`` is the bucketed peer's bucket (its default); ``works`` picks the groups.
    """

    works: tuple[str, ...] = PEER_WORKS
    linear_lengths: tuple[int, ...] = (1024, 2048, 4096, 8192, 16384)
    exact_lengths: tuple[int, ...] = (2048, 4096, 8192)
    local_length: int = 8192
    block_size: int = 128
    linear_bucket: int = 64
    batch: int = 1
    heads: int = 8
    head_dim: int = 64
    dtype: str = "float32"
    mha_batch: int = 8
    mha_length: int = 256
    mha_d_model: int = 256
    mha_heads: int = 8
    rounds: int = 3
    measure_memory: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("works", "linear_lengths", "exact_lengths"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        unknown = [w for w in self.works if w not in PEER_WORKS]
        if unknown or not self.works:
            raise ValueError(f"works must be a non-empty subset of {PEER_WORKS}, got {self.works}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {_DTYPES}, got {self.dtype!r}")
        for n in (*self.linear_lengths, *self.exact_lengths):
            check_positive_int("each length", n)
        for name in ("local_length", "block_size", "linear_bucket", "batch", "heads", "head_dim", "mha_batch",
                     "mha_length", "mha_d_model", "mha_heads", "rounds"):
            check_positive_int(name, getattr(self, name))
        if "local" in self.works and self.local_length % self.block_size:
            raise ValueError(f"local_length {self.local_length} must be a multiple of block_size {self.block_size} "
                             "(local-attention's LocalAttention needs whole windows)")
        if "mha" in self.works and self.mha_d_model % self.mha_heads:
            raise ValueError(f"mha_heads {self.mha_heads} must divide mha_d_model {self.mha_d_model}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)


# What each implementation computes, printed under the table.
PEER_LABELS = {
    "fused": "F.scaled_dot_product_attention (PyTorch's fused kernel)",
    "ours_linear": "attn-course linear_attention(is_causal=True)",
    "lat_exact": "causal_linear_attn(bucket_size=1)",
    "lat_bucketed": "causal_linear_attn(bucket_size={bucket})",
    "ours_chunked": "attn-course chunked_attention",
    "mea": "memory_efficient_attention",
    "flash": "FlashAttentionFunction",
    "ours_block": "attn-course sparse_attention(block)",
    "local_block": "LocalAttention(look_backward=0)",
    "ours_sliding": "attn-course sparse_attention(sliding)",
    "local_sliding": "LocalAttention(look_backward=1, exact_windowsize)",
    "ours_mha": "attn-course MultiHeadAttention",
    "torch_mha": "torch.nn.MultiheadAttention",
}
OURS = {"linear": "ours_linear", "exact": "ours_chunked", "local": None, "mha": "ours_mha"}


def _peer_inputs(config: PeersBenchConfig, length: int, device: torch.device, *, grad: bool = False):
    """Seeded q, k, v ``(B, H, N, D)`` and an output gradient, made on CPU so every device sees the same numbers."""
    generator = torch.Generator().manual_seed(config.seed + length)
    shape = (config.batch, config.heads, length, config.head_dim)
    q, k, v, grad_out = (torch.randn(shape, generator=generator).to(device=device, dtype=config.torch_dtype)
                         for _ in range(4))
    return (q.requires_grad_(grad), k.requires_grad_(grad), v.requires_grad_(grad)), grad_out


def _quiet_checkpoint_warning() -> None:
    import warnings

    # memory_efficient_attention calls torch.utils.checkpoint without use_reentrant (its 0.1.6).
    warnings.filterwarnings("ignore", message=".*use_reentrant.*")


def _attention_impl(key: str, config: PeersBenchConfig, *, causal: bool, peers: dict | None) -> Callable:
    """``f(q, k, v) -> out`` (B, H, N, Dv) for one implementation of one comparison."""
    block = config.block_size
    if key == "fused":
        return lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
    if key == "ours_chunked":
        return lambda q, k, v: chunked_attention(q, k, v, is_causal=causal)
    if key == "ours_linear":
        scale = config.head_dim ** -0.5

        def ours_linear(q, k, v):
            # phi(q') = exp(log(softmax(q) / sqrt(D))) = the peer's query features; phi(k) = exp(k) = its key features
            q_features_log = torch.log_softmax(q, dim=-1) + math.log(scale)  # (B, H, N, D)
            return linear_attention(q_features_log, k, v, feature_map=torch.exp, is_causal=True, eps=0.0)

        return ours_linear
    if key == "ours_block":
        return lambda q, k, v: sparse_attention(q, k, v, pattern="block", size=block, is_causal=True)
    if key == "ours_sliding":
        return lambda q, k, v: sparse_attention(q, k, v, pattern="sliding", size=block, is_causal=True)
    if peers is None:
        raise ValueError(f"{key} is a peer: load_peers() first")
    if key == "lat_exact":
        return lambda q, k, v: peers["causal_linear_attn"](q, k, v, bucket_size=1, eps=0.0)
    if key == "lat_bucketed":
        # its default eps (1e-3): the first bucket sees no key at all, and 0 / max(0, eps) gives it zeros
        return lambda q, k, v: peers["causal_linear_attn"](q, k, v, bucket_size=config.linear_bucket)
    if key == "mea":
        return lambda q, k, v: peers["memory_efficient_attention"](q, k, v, causal=causal)
    if key == "flash":
        return lambda q, k, v: peers["FlashAttentionFunction"].apply(q, k, v, None, causal, 512, 1024)
    if key in ("local_block", "local_sliding"):
        sliding = key == "local_sliding"
        module = peers["LocalAttention"](window_size=block, causal=True, look_backward=1 if sliding else 0,
                                         exact_windowsize=sliding, use_rotary_pos_emb=False)
        return lambda q, k, v: module(q, k, v)
    raise ValueError(f"unknown implementation {key!r}")


def _step(fn: Callable, inputs: tuple[torch.Tensor, ...], grad_out: torch.Tensor, *, backward: bool) -> Callable:
    """A call of ``fn`` to time: forward under no_grad, or forward+backward returning (out, dq, dk, dv)."""
    if not backward:
        def forward() -> tuple[torch.Tensor, ...]:
            with torch.no_grad():
                return (fn(*inputs),)

        return forward

    def forward_backward() -> tuple[torch.Tensor, ...]:
        # .backward() rather than autograd.grad: memory_efficient_attention's reentrant checkpoint refuses .grad()
        for x in inputs:
            x.grad = None
        out = fn(*inputs)
        out.backward(grad_out)
        return (out.detach(), *(x.grad for x in inputs))

    return forward_backward


def _max_abs_diff(a: tuple[torch.Tensor, ...], b: tuple[torch.Tensor, ...]) -> float:
    return max((x.double() - y.double()).abs().max().item() for x, y in zip(a, b))


def _time_with_outputs(steps: dict[str, Callable], *, device: torch.device, rounds: int, reference: str | None):
    """Run each step once (its output kept for the differences), then time all of them interleaved.

    Returns ``(median seconds, max |difference| from the reference's outputs)``, one entry per step.
    """
    first, outputs = {}, {}
    for name, step in steps.items():
        start = time.perf_counter()
        outputs[name] = step()
        synchronize(device)
        first[name] = time.perf_counter() - start
    reference = reference if reference in outputs else None
    diffs = {name: (None if reference is None else _max_abs_diff(out, outputs[reference]))
             for name, out in outputs.items()}
    del outputs
    return _interleaved_times(steps, device=device, rounds=rounds, first=first), diffs


def _measure_peer_in_this_process(request: dict) -> dict:
    """Peak memory of one exact-attention call (forward, or forward+backward) in a fresh process."""
    try:
        torch.set_num_threads(request["threads"])
        _quiet_checkpoint_warning()
        config = PeersBenchConfig(**request["config"])
        key, length, causal, backward = request["impl"], request["length"], request["causal"], request["backward"]
        peers = load_peers() if key in ("mea", "flash") else None
        inputs, grad_out = _peer_inputs(config, length, torch.device("cpu"), grad=backward)
        if key == "none":
            return {**peak_memory_bytes(lambda: None), "method": "child process"}
        fn = _attention_impl(key, config, causal=causal, peers=peers)
        tiny, tiny_grad = _peer_inputs(config, min(length, 64), torch.device("cpu"), grad=backward)
        _step(fn, tiny, tiny_grad, backward=backward)()  # one-time set-up is not the call's memory
        measured = peak_memory_bytes(_step(fn, inputs, grad_out, backward=backward))
        return {**measured, "method": "child process " + measured["method"]}
    except Exception as exc:  # reported to the parent, which prints it
        return {"bytes": None, "method": "child process", "error": f"{type(exc).__name__}: {exc}"}


def _peer_peak_memory(key: str, config: PeersBenchConfig, length: int, *, causal: bool, backward: bool,
                      device: torch.device, peers: dict) -> dict:
    if device.type != "cpu":  # the device's allocator counts for itself: measure here
        if key == "none":
            return {"bytes": 0, "method": "torch.cuda.max_memory_allocated", "error": None}
        inputs, grad_out = _peer_inputs(config, length, device, grad=backward)
        step = _step(_attention_impl(key, config, causal=causal, peers=peers), inputs, grad_out, backward=backward)
        return peak_memory_bytes(step, device=device)
    request = {"kind": "peers", "impl": key, "length": length, "causal": causal, "backward": backward,
               "config": dataclasses.asdict(config), "threads": torch.get_num_threads()}
    return _memory_server_handle().measure(request)


def _linear_prefix_bytes(config: PeersBenchConfig, length: int) -> int:
    """What ``causal_linear_attn(bucket_size=1)`` holds at once: about three (B, H, N, D, Dv) tensors."""
    return 3 * config.batch * config.heads * length * config.head_dim**2 * torch.empty((), dtype=config.torch_dtype).element_size()


def _available_memory_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _comparisons(config: PeersBenchConfig) -> list[dict]:
    """Every comparison the config asks for: its work, length, causality, pass, and implementations."""
    out = []
    if "linear" in config.works:
        for n in config.linear_lengths:
            impls = ["ours_linear", "lat_exact", "fused"]
            if n % config.linear_bucket == 0:
                impls.insert(2, "lat_bucketed")
            out.append({"work": "linear", "length": n, "causal": True, "backward": False, "impls": impls})
    if "exact" in config.works:
        for causal in (False, True):
            for backward in (False, True):
                for n in config.exact_lengths:
                    out.append({"work": "exact", "length": n, "causal": causal, "backward": backward,
                                "impls": ["ours_chunked", "mea", "flash", "fused"]})
    if "local" in config.works:
        for pattern in ("block", "sliding"):
            out.append({"work": "local", "pattern": pattern, "length": config.local_length, "causal": True,
                        "backward": False, "impls": [f"ours_{pattern}", f"local_{pattern}", "fused"]})
    if "mha" in config.works:
        out.append({"work": "mha", "length": config.mha_length, "causal": False, "backward": True,
                    "impls": ["ours_mha", "torch_mha"]})
    return out


def _describe(comparison: dict, config: PeersBenchConfig) -> str:
    work, n = comparison["work"], comparison["length"]
    which = ("causal" if comparison["causal"] else "non-causal") + ", " + (
        "forward+backward" if comparison["backward"] else "forward")
    if work == "linear":
        return f"causal linear attention, forward, N={n}"
    if work == "exact":
        return f"exact attention, {which}, N={n}"
    if work == "local":
        name = "block-local" if comparison["pattern"] == "block" else "sliding window"
        return f"{name} causal, block {config.block_size}, forward, N={n}"
    return (f"MultiHeadAttention forward+backward, B={config.mha_batch} L={n} E={config.mha_d_model} "
            f"H={config.mha_heads}")


def _mha_steps(config: PeersBenchConfig, device: torch.device) -> dict[str, Callable]:
    torch.manual_seed(config.seed)
    reference = nn.MultiheadAttention(config.mha_d_model, config.mha_heads, batch_first=True, device=device,
                                      dtype=config.torch_dtype)
    ours = MultiHeadAttention.from_torch(reference)
    generator = torch.Generator().manual_seed(config.seed)
    x = torch.randn(config.mha_batch, config.mha_length, config.mha_d_model, generator=generator)
    x = x.to(device=device, dtype=config.torch_dtype).requires_grad_(True)  # (B, L, E)
    grad_out = torch.randn(x.shape, generator=generator).to(device=device, dtype=config.torch_dtype)

    def ours_step():
        x.grad = None
        ours.zero_grad(set_to_none=True)
        out = ours(x)  # (B, L, E)
        out.backward(grad_out)
        return (out.detach(), x.grad, *(p.grad for p in ours.parameters()))

    def torch_step():
        x.grad = None
        reference.zero_grad(set_to_none=True)
        out = reference(x, x, x, need_weights=False)[0]  # (B, L, E)
        out.backward(grad_out)
        # the same order as ours: x, then W_q, b_q, W_k, b_k, W_v, b_v, W_o, b_o (torch stacks q, k, v)
        d_in_w, d_in_b = reference.in_proj_weight.grad.chunk(3), reference.in_proj_bias.grad.chunk(3)  # 3 x (E, E), (E,)
        return (out.detach(), x.grad, *sum(zip(d_in_w, d_in_b), ()), reference.out_proj.weight.grad,
                reference.out_proj.bias.grad)

    return {"ours_mha": ours_step, "torch_mha": torch_step}


def _check_mha_parameter_order(config: PeersBenchConfig) -> None:
    names = [name for name, _ in MultiHeadAttention(config.mha_d_model, config.mha_heads).named_parameters()]
    expected = ["q_proj.weight", "q_proj.bias", "k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias",
                "out_proj.weight", "out_proj.bias"]
    if names != expected:  # the gradients are compared in this order
        raise RuntimeError(f"MultiHeadAttention's parameters are {names}, the comparison expects {expected}")


def bench_peers(
    config: PeersBenchConfig | None = None,
    *,
    device: torch.device | str = "cpu",
    log: Callable[[str], None] | None = None,
) -> dict[str, object]:
    """Time the library against its peers, interleaved in one process; return a JSON-able dict.

    Keys: ``device``, ``torch``, ``threads``, ``config``, ``rows`` (one per implementation and
    comparison: ``work``, ``comparison``, ``impl``, ``label``, ``length``, ``causal``, ``backward``,
    ``time_s``, ``x_fused`` (time over the fused kernel's, or over ``nn.MultiheadAttention``'s for
    the MHA row), ``max_abs_diff`` (from ours, over the output and, with a backward pass, every
    gradient), ``peak_bytes`` (exact-attention rows, measured in a fresh process; None elsewhere),
    ``note``), ``memory_method``, ``memory_baseline_bytes`` and ``targets`` (:func:`peers_targets`).
    Raises :class:`MissingPeersError` when a peer package is missing.
    """
    config = PeersBenchConfig() if config is None else config
    if not isinstance(config, PeersBenchConfig):
        raise TypeError(f"config must be a PeersBenchConfig, got {type(config).__name__}")
    device = torch.device(device)
    say = log or (lambda message: None)
    peers = load_peers()
    _quiet_checkpoint_warning()
    if "mha" in config.works:
        _check_mha_parameter_order(config)
    rows: list[dict[str, object]] = []
    available = _available_memory_bytes()
    for comparison in _comparisons(config):
        description = _describe(comparison, config)
        say(f"timing {description}")
        n, causal, backward = comparison["length"], comparison["causal"], comparison["backward"]
        notes: dict[str, str] = {}
        if comparison["work"] == "mha":
            steps = _mha_steps(config, device)
        else:
            inputs, grad_out = _peer_inputs(config, n, device, grad=backward)
            tiny, tiny_grad = _peer_inputs(config, min(n, 2 * config.block_size), device, grad=backward)
            steps = {}
            for key in comparison["impls"]:
                if key == "lat_exact" and device.type == "cpu" and available is not None \
                        and _linear_prefix_bytes(config, n) > available / 2:
                    notes[key] = f"skipped: needs about {_linear_prefix_bytes(config, n) / 2**30:.1f} GiB"
                    continue
                if key == "flash" and config.dtype == "float64":
                    notes[key] = "skipped: it fills float32 running maxima with -float64 max, which overflows"
                    continue
                fn = _attention_impl(key, config, causal=causal, peers=peers)
                if key != "lat_bucketed" or tiny[0].shape[-2] % config.linear_bucket == 0:
                    _step(fn, tiny, tiny_grad, backward=backward)()  # one-time set-up, untimed
                steps[key] = _step(fn, inputs, grad_out, backward=backward)
        reference = OURS[comparison["work"]] or f"ours_{comparison.get('pattern')}"
        times, diffs = _time_with_outputs(steps, device=device, rounds=config.rounds, reference=reference)
        # The bucketed peer skips each query's own bucket: its matrix-product FLOPs, counted, say how much less it does.
        flops = {key: _matmul_flops(steps[key]) for key in ("ours_linear", "lat_bucketed") if key in steps}
        if comparison["work"] in ("linear", "local"):
            diffs["fused"] = None  # softmax attention over every earlier key: not the same function
        baseline_key = "torch_mha" if comparison["work"] == "mha" else "fused"
        for key in comparison["impls"]:
            label = PEER_LABELS[key].format(bucket=config.linear_bucket)
            note = notes.get(key, "")
            if key == "lat_bucketed":
                note = (f"not the same function: a query sees only keys in earlier buckets of {config.linear_bucket}"
                        " (none of its own bucket)")
                if flops.get("ours_linear") and flops.get(key):
                    note += f"; its matrix products: {flops[key] / flops['ours_linear']:.2f}x the FLOPs of ours"
            elif key == "fused" and comparison["work"] in ("linear", "local"):
                note = "softmax attention over every earlier key: the cost reference, not the same function"
            rows.append({
                "work": comparison["work"],
                "comparison": description,
                "impl": key,
                "label": label,
                "length": n,
                "causal": causal,
                "backward": backward,
                "time_s": times.get(key),
                "x_fused": None if key not in times else times[key] / times[baseline_key],
                "max_abs_diff": diffs.get(key),
                "peak_bytes": None,
                "matmul_flops": flops.get(key) if comparison["work"] == "linear" else None,
                "note": note,
            })
        say("measured (peak memory follows at the end):\n" + _format_comparison(rows[-len(comparison["impls"]):]))
        steps = inputs = grad_out = None  # free the large tensors before the next comparison
    memory_method, baseline = None, None
    if config.measure_memory and "exact" in config.works:
        if device.type == "cpu":
            floor = _peer_peak_memory("none", config, config.exact_lengths[0], causal=False, backward=False,
                                      device=device, peers=peers)
            baseline = floor["bytes"] or 0
        for row in rows:
            if row["work"] != "exact" or row["time_s"] is None:
                continue
            say(f"peak memory {row['label']}: {row['comparison']}")
            measured = _peer_peak_memory(row["impl"], config, row["length"], causal=row["causal"],
                                         backward=row["backward"], device=device, peers=peers)
            memory_method = measured["method"]
            if measured["bytes"] is not None:
                row["peak_bytes"] = max(0, measured["bytes"] - (baseline or 0))
            else:
                row["memory_error"] = measured["error"]
    results: dict[str, object] = {
        "device": str(device),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "config": dataclasses.asdict(config),
        "peers": {name: _distribution_version(name) for name in PEER_PACKAGES},
        "memory_method": memory_method,
        "memory_baseline_bytes": baseline,
        "rows": rows,
    }
    results["targets"] = peers_targets(results)
    return results


def _distribution_version(name: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _row(results: dict, comparison: str, impl: str) -> dict | None:
    for row in results["rows"]:
        if row["comparison"] == comparison and row["impl"] == impl:
            return row
    return None


def peers_targets(results: dict) -> list[dict[str, object]]:
    """Issue 22's targets as ratios from one run; ``passed`` is None where a figure is missing.

    * causal linear attention: ours / the exact peer (``bucket_size=1``) <= 1 at every N; the same
      against the bucketed peer (a cheaper function: reported, so its row says what it computes);
      ours t(16384) / t(1024) <= 18;
    * exact attention: ``chunked_attention`` / the faster of the two peers <= 1 in time, and its
      peak memory <= the smaller of theirs, for every N, causality and pass;
    * block-local and sliding window: ours / ``LocalAttention`` <= 1;
    * ``MultiHeadAttention`` / ``nn.MultiheadAttention`` <= 1.15 (``bench mha``'s target).
    """
    targets = []

    def add(text: str, value: float | None, limit: float) -> None:
        targets.append({"target": text, "value": value, "op": "<=", "limit": limit,
                        "passed": None if value is None else value <= limit})

    def ratio(top: dict | None, bottom: list[dict | None], key: str = "time_s") -> float | None:
        values = [b[key] for b in bottom if b is not None and b.get(key)]
        if top is None or top.get(key) is None or not values:
            return None
        return top[key] / min(values)

    comparisons = list(dict.fromkeys(row["comparison"] for row in results["rows"]))
    linear_times = {}
    for comparison in comparisons:
        work = next(row["work"] for row in results["rows"] if row["comparison"] == comparison)
        get = lambda impl: _row(results, comparison, impl)  # noqa: E731
        if work == "linear":
            add(f"{comparison}: ours / causal_linear_attn(bucket_size=1)", ratio(get("ours_linear"), [get("lat_exact")]), 1.0)
            if get("lat_bucketed") is not None:
                work = ratio(get("lat_bucketed"), [get("ours_linear")], key="matmul_flops")
                add(f"{comparison}: ours / causal_linear_attn(bucketed, another function"
                    + ("" if work is None else f" making {work:.2f}x our matmul FLOPs") + ")",
                    ratio(get("ours_linear"), [get("lat_bucketed")]), 1.0)
            linear_times[get("ours_linear")["length"]] = get("ours_linear")["time_s"]
        elif work == "exact":
            add(f"{comparison}: chunked / fastest peer, time", ratio(get("ours_chunked"), [get("mea"), get("flash")]), 1.0)
            if any(row.get("peak_bytes") is not None for row in results["rows"]):
                add(f"{comparison}: chunked / smallest peer, peak memory",
                    ratio(get("ours_chunked"), [get("mea"), get("flash")], key="peak_bytes"), 1.0)
        elif work == "local":
            pattern = "block" if comparison.startswith("block") else "sliding"
            add(f"{comparison}: ours / LocalAttention", ratio(get(f"ours_{pattern}"), [get(f"local_{pattern}")]), 1.0)
        elif work == "mha":
            add(f"{comparison}: ours / nn.MultiheadAttention", ratio(get("ours_mha"), [get("torch_mha")]), 1.15)
    if 1024 in linear_times and 16384 in linear_times:
        add("causal linear attention: ours t(16384) / t(1024)", linear_times[16384] / linear_times[1024], 18.0)
    return targets


def _matmul_flops(step) -> int:
    """FLOPs of the matrix products one call of ``step`` makes, counted by PyTorch's FlopCounterMode."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        step()
    return counter.get_total_flops()


def _format_comparison(rows: list[dict]) -> str:
    """One comparison's rows: the heading, then each implementation's figures."""
    lines = [rows[0]["comparison"], f"  {'implementation':<52}{'ms':>10}{'x fused':>9}{'max|diff|':>11}{'peak MiB':>10}"]
    for row in rows:
        ms = "-" if row["time_s"] is None else f"{row['time_s'] * 1e3:.2f}"
        ratio = "-" if row["x_fused"] is None else f"{row['x_fused']:.2f}"
        diff = "-" if row["max_abs_diff"] is None else f"{row['max_abs_diff']:.1e}"
        lines.append(f"  {row['label']:<52}{ms:>10}{ratio:>9}{diff:>11}{_megabytes(row['peak_bytes']):>10}"
                     + (f"  ({row['note']})" if row["note"] else ""))
    return "\n".join(lines)


def format_peers_table(results: dict) -> str:
    """The measured rows, grouped by comparison, what each row computes, and the targets."""
    cfg = results["config"]
    peers = ", ".join(f"{name} {version or '?'}" for name, version in results["peers"].items())
    lines = [
        f"attn-course against its peers on {results['device']} ({results['threads']} threads), torch {results['torch']}; "
        f"B={cfg['batch']} H={cfg['heads']} D={cfg['head_dim']} {cfg['dtype']}; median of {cfg['rounds']} interleaved rounds",
        f"peers: {peers}",
        "x fused: time over PyTorch's fused F.scaled_dot_product_attention on the same inputs "
        "(MHA: over nn.MultiheadAttention); max|diff|: from ours, output and every gradient",
        f"peak memory (exact attention): {results['memory_method'] or 'not measured'}"
        + (f"; noise floor {_megabytes(results['memory_baseline_bytes'])} MiB subtracted"
           if results["memory_baseline_bytes"] is not None else ""),
    ]
    for comparison in dict.fromkeys(row["comparison"] for row in results["rows"]):
        lines += ["", _format_comparison([r for r in results["rows"] if r["comparison"] == comparison])]
    works = set(row["work"] for row in results["rows"])
    lines += ["", "what each comparison computes (all on the same seeded inputs):"]
    if "linear" in works:
        lines.append("  causal linear attention: out_i = phi_q(q_i)^T S_i / phi_q(q_i)^T z_i, S_i = sum_{j<=i} exp(k_j) v_j^T,"
                     " z_i = sum_{j<=i} exp(k_j), phi_q(q) = softmax(q) / sqrt(D) (the peer's feature maps; eps 0)")
    if "exact" in works:
        lines.append("  exact attention: softmax(q k^T / sqrt(D)) v, causal top-left aligned (j <= i); forward+backward"
                     " = the output and dq, dk, dv for one fixed output gradient")
    if "local" in works:
        lines.append(f"  block-local: softmax over the keys of the query's own block of {cfg['block_size']}, j <= i;"
                     f" sliding window: softmax over i - {cfg['block_size']} <= j <= i")
    if "mha" in works:
        lines.append("  MultiHeadAttention: the same weights (from_torch), batch-first, no mask, need_weights=False;"
                     " output, input and weight gradients")
    lines += ["", "targets (ratios measured in this run):"]
    for target in results["targets"]:
        verdict = {True: "PASS", False: "FAIL", None: "n/a (not measured)"}[target["passed"]]
        value = "-" if target["value"] is None else f"{target['value']:.3f}"
        lines.append(f"  {target['target']}: {value} (target {target['op']} {target['limit']:.3g})  {verdict}")
    return "\n".join(lines)


def report_peers(
    config: PeersBenchConfig | None = None,
    *,
    device: torch.device | str = "cpu",
    json_path: str | os.PathLike | None = None,
) -> dict[str, object]:
    """Run :func:`bench_peers`, print its table and targets, and write the JSON if asked."""
    results = bench_peers(config, device=device, log=lambda message: print(f"  .. {message}", flush=True))
    print(format_peers_table(results), flush=True)
    if json_path is not None:
        Path(json_path).write_text(json.dumps(results, indent=2))
        print(f"wrote {json_path}")
    return results
