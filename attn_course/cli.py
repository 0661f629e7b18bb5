"""The ``attn-course`` command: benchmarks, device info, and course tooling.

    attn-course info [--device D]
    attn-course bench mha [--batch --length --d-model --heads ...]        (make bench)
    attn-course bench attention [--lengths --heads --head-dim ...]
    attn-course bench peers [--works --sizes --quick --no-memory ...]     (needs the bench extra)
    attn-course make-exercises | regenerate [NB...] | runtimes [NB...]     (maintainers)
    attn-course grade SUBMISSION... [--csv --json --tasks ...]             (instructors)

Each command imports what it needs when it runs (the grader only for ``grade``), so ``--help``
and ``info`` stay fast. A wrong argument exits with status 2 and one line on stderr naming it
-- no usage block, no traceback.
"""

from __future__ import annotations

import argparse
import json
import sys

__all__ = ["main", "build_parser"]


class _Parser(argparse.ArgumentParser):
    """``ArgumentParser`` whose errors are one line on stderr and exit status 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")

    def parse_known_args(self, args=None, namespace=None):
        # A command without subcommands refuses what it does not know itself, so the error names
        # it ("attn-course bench mha: ... --lengths") instead of the top-level parser.
        parsed, extras = super().parse_known_args(args, namespace)
        if extras and getattr(self, "_subparsers", None) is None:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return parsed, extras


class UsageError(Exception):
    """An argument that parses but cannot be used (a device that is not there, heads that do not divide)."""


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _non_negative_int(text: str) -> int:
    return 0 if text.strip() == "0" else _positive_int(text)


def _device(name: str | None):
    from .device import pick_device

    try:
        return pick_device(name)
    except (ValueError, RuntimeError) as exc:
        raise UsageError(f"--device {name}: {exc}") from None


def _cmd_info(args: argparse.Namespace) -> int:
    import torch

    from .device import describe_device

    device = _device(args.device)
    print(f"torch {torch.__version__}; device: {describe_device(device)}")
    return 0


def _start_bench(args: argparse.Namespace):
    """Pick the device and threads, print them; return the device."""
    import torch

    from .device import describe_device

    device = _device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"device: {describe_device(device)}; torch {torch.__version__}")
    return device


def _write_json(path: str | None, result: dict) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {path}")


def _cmd_bench_mha(args: argparse.Namespace) -> int:
    if args.d_model % args.heads:
        raise UsageError(f"--heads {args.heads} must divide --d-model {args.d_model} (head_dim = d_model / heads)")
    from .bench import bench_mha, matmul_gflops

    device = _start_bench(args)
    gflops = matmul_gflops(device=device)
    print(f"matmul 2048x2048 fp32: {gflops:.1f} GFLOP/s")
    r = bench_mha(device=device, batch=args.batch, length=args.length, d_model=args.d_model, num_heads=args.heads)
    print(f"MultiHeadAttention forward+backward (B={r['batch']}, L={r['length']}, E={r['d_model']}, H={r['num_heads']}):")
    print(f"  attn_course.MultiHeadAttention: {r['ours_ms']:8.2f} ms")
    print(f"  torch.nn.MultiheadAttention:    {r['torch_ms']:8.2f} ms")
    print(f"  ratio ours/torch: {r['ratio']:.3f}x (target <= 1.15x)")
    _write_json(args.json, {"device": str(device), "matmul_gflops": gflops, "mha": r})
    return 0


def _cmd_bench_attention(args: argparse.Namespace) -> int:
    from .bench import AttentionBenchConfig, report_attention

    try:
        config = AttentionBenchConfig(
            lengths=tuple(args.lengths), heads=args.heads, head_dim=args.head_dim, block_size=args.block_size,
            chunk_size=args.chunk_size, rounds=args.rounds, measure_memory=not args.no_memory,
        )
    except (ValueError, TypeError) as exc:
        raise UsageError(str(exc)) from None
    device = _start_bench(args)
    results = report_attention(config, device=device, plot_path=args.plot)
    _write_json(args.json, {"device": str(device), "attention": results})
    return 0


# `bench peers --quick`: every comparison on tiny inputs, one round, no memory: seconds, for tests and smoke runs.
_PEERS_QUICK = {"linear_lengths": (128, 256), "exact_lengths": (128,), "local_length": 128, "block_size": 64,
                "heads": 2, "head_dim": 16, "mha_batch": 2, "mha_length": 16, "mha_d_model": 32, "mha_heads": 4,
                "rounds": 1, "measure_memory": False}


def _cmd_bench_peers(args: argparse.Namespace) -> int:
    from .bench import MissingPeersError, PeersBenchConfig, load_peers, report_peers

    try:
        load_peers()  # before anything is printed: a missing extra is one line and exit status 2
    except MissingPeersError as exc:
        raise UsageError(str(exc)) from None
    fields = dict(_PEERS_QUICK) if args.quick else {}
    if args.sizes:
        fields.update(linear_lengths=tuple(args.sizes), exact_lengths=tuple(args.sizes), local_length=max(args.sizes))
    for option, field in (("linear_sizes", "linear_lengths"), ("exact_sizes", "exact_lengths")):
        if getattr(args, option):
            fields[field] = tuple(getattr(args, option))
    if args.works:
        fields["works"] = tuple(args.works)
    if args.rounds:
        fields["rounds"] = args.rounds
    if args.no_memory:
        fields["measure_memory"] = False
    try:
        config = PeersBenchConfig(**fields)
    except (ValueError, TypeError) as exc:
        raise UsageError(str(exc)) from None
    device = _start_bench(args)
    results = report_peers(config, device=device)
    _write_json(args.json, {"device": str(device), "peers": results})
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
        paths = [Path(p).resolve() for p in given]
        missing = [str(p) for p in paths if not p.is_file()]
        if missing:
            raise UsageError(f"no such notebook: {', '.join(missing)}")
        return paths
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
    from .course import RUNTIMES_FILE, load_runtimes, measured_runtimes, project_root, save_runtimes
    from .notebooks import measure_runtimes, write_course_map, write_header_times

    root = project_root()
    paths = _notebook_paths(args.paths)
    seconds = {}
    if args.paths and (root / RUNTIMES_FILE).exists():
        seconds = dict(load_runtimes(root / RUNTIMES_FILE).seconds)  # timing a few notebooks keeps the others' figures
    for path, took in measure_runtimes(paths):
        key = path.relative_to(root).as_posix()
        seconds[key] = round(took, 1)
        print(f"{took:6.1f} s  {key}", flush=True)
    runtimes = measured_runtimes(seconds)
    print(f"wrote {save_runtimes(runtimes, root / RUNTIMES_FILE)}")
    print(f"updated the course map in {write_course_map(runtimes, root=root)}")
    for path in write_header_times(runtimes, root=root):
        print(f"updated the time to run in {path.relative_to(root).as_posix()}")
    return 0


def _grade(argv: list[str]) -> int:
    """``attn-course grade``: the only command that imports the grader."""
    from .grading import batch

    parser = _Parser(prog="attn-course grade", description="grade submitted notebooks, each in its own sandbox (bubblewrap), and write CSV/JSON grade sheets")
    batch.add_arguments(parser)  # the grader's options live next to the grader
    return batch.run_from_args(parser.parse_args(argv))


def build_parser() -> argparse.ArgumentParser:
    """The parser of every command but ``grade``'s own options (those come with the grader, when it runs)."""
    parser = _Parser(prog="attn-course", description="Tools for the attn-course notebooks.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    info = sub.add_parser("info", help="print torch version and the device the course will use")
    info.add_argument("--device", default=None, help="cpu, cuda or mps (default: the best available)")
    info.set_defaults(func=_cmd_info)

    bench = sub.add_parser("bench", help="run a benchmark and print measured figures")
    targets = bench.add_subparsers(dest="target", required=True, metavar="TARGET")
    common = _Parser(add_help=False)
    common.add_argument("--device", default=None, help="cpu, cuda or mps (default: the best available)")
    common.add_argument("--threads", type=_non_negative_int, default=0, help="torch threads (default: torch's choice)")
    common.add_argument("--json", default=None, help="also write the figures to this JSON file")

    mha = targets.add_parser(
        "mha", parents=[common], help="MultiHeadAttention vs nn.MultiheadAttention, forward+backward, as a ratio"
    )
    mha.add_argument("--batch", type=_positive_int, default=8, help="batch size B")
    mha.add_argument("--length", type=_positive_int, default=256, help="sequence length L")
    mha.add_argument("--d-model", type=_positive_int, default=256, help="model dim E")
    mha.add_argument("--heads", type=_positive_int, default=8, help="heads H (must divide --d-model)")
    mha.set_defaults(func=_cmd_bench_mha)

    attention = targets.add_parser(
        "attention", parents=[common],
        help="time and peak memory against sequence length: dense, fused, block-local, linear, chunked",
    )
    attention.add_argument("--lengths", type=_positive_int, nargs="+", default=[1024, 2048, 4096, 8192, 16384],
                           help="sequence lengths N (B=1, fp32)")
    attention.add_argument("--heads", type=_positive_int, default=8, help="heads H")
    attention.add_argument("--head-dim", type=_positive_int, default=64, help="head dim D")
    attention.add_argument("--block-size", type=_positive_int, default=128, help="block-local block")
    attention.add_argument("--chunk-size", type=_positive_int, default=1024, help="chunked query/key chunk")
    attention.add_argument("--rounds", type=_positive_int, default=3, help="interleaved timing rounds (median)")
    attention.add_argument("--no-memory", action="store_true", help="skip the peak-memory measurements")
    attention.add_argument("--plot", default=None, help="save the time/memory plot to this PNG")
    attention.set_defaults(func=_cmd_bench_attention)

    peers = targets.add_parser(
        "peers", parents=[common],
        help="the library against pure-PyTorch peers from PyPI (the bench extra): times, ratios to fused, exactness",
    )
    peers.add_argument("--works", nargs="+", choices=["linear", "exact", "local", "mha"], default=None,
                       help="which comparisons (default: all)")
    peers.add_argument("--sizes", type=_positive_int, nargs="+", default=None,
                       help="sequence lengths for linear and exact attention; block-local uses the largest")
    peers.add_argument("--linear-sizes", type=_positive_int, nargs="+", default=None,
                       help="causal linear attention lengths (default 1024 .. 16384)")
    peers.add_argument("--exact-sizes", type=_positive_int, nargs="+", default=None,
                       help="exact attention lengths (default 2048 4096 8192)")
    peers.add_argument("--rounds", type=_positive_int, default=0, help="interleaved timing rounds (median; default 3)")
    peers.add_argument("--no-memory", action="store_true", help="skip the peak-memory measurements")
    peers.add_argument("--quick", action="store_true",
                       help="tiny inputs, one round, no memory: checks that everything runs, in seconds")
    peers.set_defaults(func=_cmd_bench_peers)

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

    # Listed for --help; main() hands `grade ...` to the grader's own parser before this one runs.
    sub.add_parser("grade", help="grade submitted notebooks, each in its own sandbox; write CSV/JSON (see grade --help)")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["grade"]:
        return _grade(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except UsageError as exc:
        where = f"attn-course {args.command}" + (f" {args.target}" if getattr(args, "target", None) else "")
        print(f"{where}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
