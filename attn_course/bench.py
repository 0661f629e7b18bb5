"""Benchmarks that print measured numbers: times, peak memory, ratios, and the machine's matmul rate.

* ``attn-course bench mha``: ``MultiHeadAttention`` against ``nn.MultiheadAttention``.
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
from .measure import peak_memory_bytes, synchronize, time_call
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
    "bench_attention",
    "attention_targets",
    "format_attention_table",
    "plot_attention_bench",
    "report_attention",
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


def _interleaved_times(fns: dict[str, Callable[[], object]], *, device: torch.device, rounds: int) -> dict[str, float]:
    """Median seconds per call of each function, measured in interleaved rounds."""
    samples: dict[str, list[float]] = {name: [] for name in fns}
    repeats = {}
    for name, fn in fns.items():  # the first call warms up and estimates the cost
        start = time.perf_counter()
        fn()
        synchronize(device)
        first = time.perf_counter() - start
        repeats[name] = max(1, min(50, int(0.05 / max(first, 1e-9))))  # about 50 ms per sample
        if first > 1.0:
            samples[name].append(first)  # a call this long is its own warm-up: do not pay for it twice
    names = list(fns)
    for round_index in range(rounds):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:  # a rotating order, so no variant always goes first
            if len(samples[name]) < rounds:
                samples[name].append(time_call(fns[name], device=device, warmup=0, repeats=repeats[name]))
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
    ``time_s``, ``flops``, ``gflops``, ``matmul_gflops``, ``fraction_of_matmul``,
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
            times = _interleaved_times(fns, device=device, rounds=config.rounds)
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
        time_axes.plot(lengths, [p["time_s"] * 1e3 for p in points], marker="o", label=LABELS[variant])
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
