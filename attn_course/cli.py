"""The ``attn-course`` command: benchmarks, device info, and course tooling."""

from __future__ import annotations

import argparse
import json
import sys

__all__ = ["main"]


def _cmd_info(args: argparse.Namespace) -> int:
    import torch

    from .device import describe_device, pick_device

    device = pick_device(args.device)
    print(f"torch {torch.__version__}; device: {describe_device(device)}")
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    import torch

    from .bench import bench_mha, matmul_gflops
    from .device import describe_device, pick_device

    device = pick_device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"device: {describe_device(device)}; torch {torch.__version__}")
    gflops = matmul_gflops(device=device)
    print(f"matmul 2048x2048 fp32: {gflops:.1f} GFLOP/s")
    result: dict[str, object] = {"device": str(device), "matmul_gflops": gflops}
    if args.target in ("mha", "all"):
        r = bench_mha(device=device, batch=args.batch, length=args.length, d_model=args.d_model, num_heads=args.heads)
        print(
            f"MultiHeadAttention forward+backward (B={r['batch']}, L={r['length']}, E={r['d_model']}, "
            f"H={r['num_heads']}):"
        )
        print(f"  attn_course.MultiHeadAttention: {r['ours_ms']:8.2f} ms")
        print(f"  torch.nn.MultiheadAttention:    {r['torch_ms']:8.2f} ms")
        print(f"  ratio ours/torch: {r['ratio']:.3f}x (target <= 1.15x)")
        result["mha"] = r
    if args.target in ("attention", "all"):
        from .bench import AttentionBenchConfig, report_attention

        config = AttentionBenchConfig(
            lengths=tuple(args.lengths), heads=args.heads, head_dim=args.head_dim, block_size=args.block_size,
            chunk_size=args.chunk_size, rounds=args.rounds, measure_memory=not args.no_memory,
        )
        result["attention"] = report_attention(config, device=device, plot_path=args.plot)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {args.json}")
    return 0


def _cmd_make_exercises(args: argparse.Namespace) -> int:
    from .notebooks import make_exercises

    for path in make_exercises():
        print(f"wrote {path}")
    return 0


def _notebook_paths(given: list[str]) -> list:
    from pathlib import Path

    from .course import project_root

    if given:
        return [Path(p).resolve() for p in given]
    root = project_root()
    return sorted((root / "notebooks").glob("*.ipynb")) + sorted((root / "solutions").glob("*.ipynb"))


def _cmd_regenerate(args: argparse.Namespace) -> int:
    from .notebooks import make_exercises, regenerate

    paths = _notebook_paths(args.paths)
    for path, seconds in regenerate(paths):
        print(f"{seconds:6.1f} s  {path}")
    if not args.paths:
        for path in make_exercises():
            print(f"wrote {path}")
    return 0


def _cmd_runtimes(args: argparse.Namespace) -> int:
    import datetime
    import os
    import platform

    import nbformat
    import torch

    from .course import (
        COURSE_MAP_HEADING,
        RUNTIMES_FILE,
        Runtimes,
        course_map_markdown,
        load_runtimes,
        project_root,
        save_runtimes,
    )
    from .notebooks import measure_runtimes

    root = project_root()
    paths = _notebook_paths(args.paths)
    seconds = {}
    if args.paths and (root / RUNTIMES_FILE).exists():
        seconds = dict(load_runtimes().seconds)  # measuring a few notebooks keeps the others' figures
    for path, took in measure_runtimes(paths):
        key = path.relative_to(root).as_posix()
        seconds[key] = round(took, 1)
        print(f"{took:6.1f} s  {key}", flush=True)
    gpu = f"with a {torch.cuda.get_device_name()} GPU" if torch.cuda.is_available() else "without a GPU"
    machine = f"a {os.cpu_count()}-core {platform.machine()} CPU {gpu}"
    threads = int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads()))
    runtimes = Runtimes(machine=machine, threads=threads, date=datetime.date.today().isoformat(), seconds=seconds)
    print(f"wrote {save_runtimes(runtimes)}")

    welcome_path = root / "notebooks" / "00_welcome.ipynb"
    welcome = nbformat.read(welcome_path, as_version=4)
    cell = next(c for c in welcome.cells if c.cell_type == "markdown" and c.source.startswith(COURSE_MAP_HEADING))
    cell.source = course_map_markdown(runtimes)
    welcome_path.write_text(nbformat.writes(welcome) + "\n")
    print(f"updated the course map in {welcome_path}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="attn-course", description="Tools for the attn-course notebooks.")
    sub = parser.add_subparsers(dest="command", required=True)

    info = sub.add_parser("info", help="print torch version and the device the course will use")
    info.add_argument("--device", default=None)
    info.set_defaults(func=_cmd_info)

    bench = sub.add_parser("bench", help="run a benchmark and print measured figures")
    bench.add_argument("target", choices=["mha", "attention", "all"], help="what to benchmark")
    bench.add_argument("--device", default=None)
    bench.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's choice)")
    bench.add_argument("--batch", type=int, default=8)
    bench.add_argument("--length", type=int, default=256)
    bench.add_argument("--d-model", type=int, default=256)
    bench.add_argument("--heads", type=int, default=8)
    bench.add_argument("--json", default=None, help="also write the figures to this JSON file")
    bench.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384],
                       help="attention: sequence lengths N (B=1, fp32)")
    bench.add_argument("--head-dim", type=int, default=64, help="attention: head dim D")
    bench.add_argument("--block-size", type=int, default=128, help="attention: block-local block")
    bench.add_argument("--chunk-size", type=int, default=1024, help="attention: chunked query/key chunk")
    bench.add_argument("--rounds", type=int, default=3, help="attention: interleaved timing rounds (median)")
    bench.add_argument("--no-memory", action="store_true", help="attention: skip the peak-memory measurements")
    bench.add_argument("--plot", default=None, help="attention: save the time/memory plot to this PNG")
    bench.set_defaults(func=_cmd_bench)

    exercises = sub.add_parser("make-exercises", help="regenerate exercises/ from solutions/")
    exercises.set_defaults(func=_cmd_make_exercises)

    regen = sub.add_parser(
        "regenerate", help="re-execute notebooks in place (default: all lessons and solutions, then exercises)"
    )
    regen.add_argument("paths", nargs="*", help="notebooks to execute (default: notebooks/*.ipynb solutions/*.ipynb)")
    regen.set_defaults(func=_cmd_regenerate)

    runtimes = sub.add_parser(
        "runtimes",
        help="time notebooks top to bottom (default: all lessons and solutions); "
        "write notebooks/runtimes.json and 00_welcome's course map",
    )
    runtimes.add_argument("paths", nargs="*", help="notebooks to time (default: notebooks/*.ipynb solutions/*.ipynb)")
    runtimes.set_defaults(func=_cmd_runtimes)

    from .grading import batch  # the grader's options live next to the grader

    grade = sub.add_parser("grade", help="grade submitted notebooks in separate processes; write CSV/JSON")
    batch.add_arguments(grade)
    grade.set_defaults(func=batch.run_from_args)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
