"""`make gpu-check`: every CUDA case of the course, on a machine with a GPU, in one command and 8 minutes.

    python3 tests/gpu_check.py [--report gpu-check-report.md] [--budget 480] [--site DIR]
    python3 tests/gpu_check.py bundle [--into .gpu-site]     (here, before a GPU run: see "Python" below)

Steps, each with its own time limit and all within ``--budget`` seconds (default 480):

1. environment: the interpreter, torch and its CUDA, the GPU, where ``attn_course`` is imported from,
   which optional tools are there;
2. the CUDA test cases: every test id that ``tests/conftest.py`` parametrizes with ``cuda``
   (collected without ``--device``, so the same ids exist on a CPU), run with ``pytest --device cuda``;
3. lessons 04 and 12 on the GPU: a temporary copy of each, executed with ``ATTN_COURSE_DEVICE=cuda``
   (``attn_course.device.pick_device`` reads it) -- by nbconvert when nbconvert and ipykernel are
   importable, otherwise cell by cell in one Python namespace (IPython magics dropped, cells tagged
   ``raises-exception`` must raise, ``skip-execution`` cells skipped); claims that do not hold on
   the GPU are counted from the output (``ac.claim`` prints "not on this machine");
4. ``attn-course bench mha``, ``bench attention`` and ``bench peers`` with ``--device cuda``; ``bench
   peers`` exits 2 when the peer packages (the ``bench`` extra) are missing: that step is then
   reported as skipped, not failed.

It writes one report (markdown): each step's status, seconds, limit and the tail of its output.

Without CUDA (this machine, CI) the GPU steps are skipped with a message saying so and the parts
that need no GPU still run, as a rehearsal that fits the budget: the environment, collecting the
CUDA test ids, compiling every code cell of lessons 04 and 12 as the cell runner would run it, and
checking whether the peers are importable. Exit status: 0 when every step passed or was skipped
(no CUDA included), 1 when a step failed or ran out of time, 2 for a wrong argument.

Python: every step runs under the interpreter that runs this script. On the course's GPU machine
(nvidia-h200, lent through the device tool: bare, no network, a copy of the working tree only)
``python3`` is the image's own, with a CUDA build of torch, numpy, matplotlib, scipy, scikit-learn,
tqdm, einops, pytest, pytest-timeout and hypothesis; the course's package is used from the working
tree (``PYTHONPATH``), nothing is installed. Not there: nbconvert/ipykernel (the cell runner
stands in) and the three peer packages. To bring the peers, run ``python tests/gpu_check.py bundle``
here with the course's venv: it copies them and their pure-Python requirements from that venv into
``.gpu-site/`` (git-ignored, under 1 MB), which travels when the device call carries it and which
this script puts on ``PYTHONPATH`` when present. ``make gpu-check`` runs it with ``$(PYTHON)``
(default ``python3``) and never builds the venv.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LESSONS = ("notebooks/04_cost_of_attention.ipynb", "notebooks/12_attention_across_devices.ipynb")
# Seconds per step; the steps run in this order and each gets at most what is left of --budget.
LIMITS = {
    "environment": 30,
    "collect CUDA test ids": 75,
    "pytest --device cuda": 155,
    "lesson 04 on cuda": 45,
    "lesson 12 on cuda": 60,
    "bench mha": 20,
    "bench attention": 60,
    "bench peers": 75,
}
PEER_DISTRIBUTIONS = ("linear-attention-transformer", "memory-efficient-attention-pytorch", "local-attention")
# Already on the GPU image (KINDS.md), or torch itself: not bundled.
ON_THE_IMAGE = {"torch", "einops", "numpy", "triton", "packaging"}
TAIL_LINES = 40


# ------------------------------------------------------------------------------------------ running steps


class Step:
    def __init__(self, name: str, limit: float) -> None:
        self.name, self.limit = name, limit
        self.status, self.seconds, self.output, self.detail = "not run", 0.0, "", ""

    def as_dict(self) -> dict:
        return {"step": self.name, "status": self.status, "seconds": round(self.seconds, 1), "limit_s": self.limit,
                "detail": self.detail, "output_tail": tail(self.output)}


def tail(text: str, lines: int = TAIL_LINES) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])


def run_command(step: Step, command: list[str], *, env: dict, cwd: Path = ROOT) -> int | None:
    """Run ``command`` with ``step.limit`` seconds; the return code, or None when it ran out of time."""
    start = time.monotonic()
    process = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, start_new_session=True)
    try:
        output, _ = process.communicate(timeout=step.limit)
        code = process.returncode
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)  # the whole group: pytest workers, notebook kernels
        output, _ = process.communicate()
        code = None
    step.seconds = time.monotonic() - start
    step.output = output or ""
    if code is None:
        step.status, step.detail = "timed out", f"stopped after {step.limit:.0f} s"
    elif step.status == "not run":
        step.status = "passed" if code == 0 else "failed"
        if code:
            step.detail = f"exit status {code}"
    return code


def python_step(step: Step, code: str, *, env: dict) -> int | None:
    return run_command(step, [sys.executable, "-c", code], env=env)


# ------------------------------------------------------------------------------------------ the notebook runner


def notebook_cells(path: Path) -> list[dict]:
    return [c for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]


def cell_code(cell: dict) -> str:
    """The cell's source as plain Python: IPython magics and shell lines become comments."""
    source = cell["source"] if isinstance(cell["source"], str) else "".join(cell["source"])
    return "\n".join("# " + line if line.lstrip().startswith(("%", "!")) else line for line in source.splitlines())


def run_notebook(path: Path) -> int:
    """Execute a notebook's code cells in one namespace, printing as a kernel would; 1 at the first error."""
    import traceback

    os.environ.setdefault("MPLBACKEND", "Agg")
    namespace: dict = {"__name__": "__main__", "display": print}
    for index, cell in enumerate(notebook_cells(path)):
        tags = set(cell.get("metadata", {}).get("tags", []))
        if "skip-execution" in tags:
            continue
        print(f"--- cell {index}", flush=True)
        try:
            exec(compile(cell_code(cell), f"{path.name}[cell {index}]", "exec"), namespace)
        except Exception:
            if "raises-exception" in tags:
                print("(raised, as its tag says)", flush=True)
                continue
            traceback.print_exc(file=sys.stdout)
            print(f"FAILED at code cell {index}", flush=True)
            return 1
        else:
            if "raises-exception" in tags:
                print(f"FAILED: code cell {index} is tagged raises-exception and did not raise", flush=True)
                return 1
        try:
            import matplotlib.pyplot as plt

            plt.close("all")
        except ImportError:
            pass
    print("every cell ran", flush=True)
    return 0


def rehearse_notebook(path: Path) -> int:
    """What the rehearsal checks without a GPU: every cell compiles, and the setup runs (imports, device)."""
    cells = notebook_cells(path)
    for index, cell in enumerate(cells):
        compile(cell_code(cell), f"{path.name}[cell {index}]", "exec")
    setup = next((i for i, cell in enumerate(cells) if "pick_device(" in cell_code(cell)), None)
    if setup is None:
        print(f"{path.name}: no cell calls pick_device, so ATTN_COURSE_DEVICE would not reach it")
        return 1
    namespace: dict = {"__name__": "__main__", "display": print}
    for index, cell in enumerate(cells[: setup + 1]):
        try:
            exec(compile(cell_code(cell), f"{path.name}[cell {index}]", "exec"), namespace)
        except Exception as exc:
            print(f"{path.name}: its setup fails at code cell {index}: {type(exc).__name__}: {exc}")
            return 1
    print(f"{path.name}: {len(cells)} code cells compile; its setup (cells 0-{setup}) ran on {namespace.get('device')}")
    return 0


def has_modules(env: dict, *names: str) -> bool:
    code = "import importlib.util, sys; sys.exit(0 if all(importlib.util.find_spec(n) for n in sys.argv[1:]) else 1)"
    return subprocess.run([sys.executable, "-c", code, *names], env=env, cwd=ROOT).returncode == 0


def lesson_step(step: Step, lesson: str, *, env: dict, cuda: bool, scratch: Path) -> None:
    source = ROOT / lesson
    if not cuda:
        step.status, step.detail = "skipped", "no CUDA: every code cell compiled and the setup cells run instead (rehearsal)"
        if run_command(step, [sys.executable, __file__, "rehearse-notebook", str(source)], env=env, cwd=source.parent) != 0:
            step.status = "failed"
        return
    # A temporary copy beside the original, so relative paths (data, runtimes.json) resolve as in Jupyter.
    copy = source.with_name(f".gpu-check-{source.name}")
    shutil.copyfile(source, copy)
    lesson_env = {**env, "ATTN_COURSE_DEVICE": "cuda", "MPLBACKEND": "Agg"}
    try:
        if has_modules(env, "nbconvert", "ipykernel"):
            step.detail = "nbconvert --execute"
            output = scratch / source.name
            code = run_command(step, [sys.executable, "-m", "jupyter", "nbconvert", "--to", "notebook", "--execute",
                                      f"--ExecutePreprocessor.timeout={int(step.limit)}", "--output-dir", str(scratch),
                                      "--output", source.name, str(copy)],
                               env=lesson_env, cwd=source.parent)
            if code == 0:
                step.output += "\n" + notebook_text(output)
        else:
            step.detail = "cell runner (no nbconvert/ipykernel here)"
            run_command(step, [sys.executable, __file__, "run-notebook", str(copy)], env=lesson_env, cwd=source.parent)
    finally:
        copy.unlink(missing_ok=True)
    misses = step.output.count("not on this machine")
    if misses:
        step.detail += f"; {misses} claim(s) do not hold on this GPU (see the output)"


def notebook_text(path: Path) -> str:
    """The stream outputs of an executed notebook, for the report's tail."""
    if not path.exists():
        return ""
    lines = []
    for cell in notebook_cells(path):
        for out in cell.get("outputs", []):
            if out.get("output_type") == "stream":
                text = out["text"]
                lines.append(text if isinstance(text, str) else "".join(text))
    return "".join(lines)


# ------------------------------------------------------------------------------------------ the check


def device_test_files() -> list[str]:
    """The test modules with a test or fixture taking ``device`` (conftest parametrizes those with cpu/cuda/mps)."""
    pattern = re.compile(r"def \w+\([^)]*\bdevice\b", re.DOTALL)
    return sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_*.py") if pattern.search(p.read_text()))


def collect_cuda_ids(step: Step, *, env: dict) -> list[str]:
    """Test ids parametrized with the cuda device (the same ids with and without a GPU)."""
    run_command(step, [sys.executable, "-m", "pytest", *device_test_files(), "--collect-only", "-q",
                       "-p", "no:cacheprovider"], env=env)
    ids = [line.strip() for line in step.output.splitlines() if "::" in line and re.search(r"\[(.*-)?cuda(-.*)?\]", line)]
    # Collection errors (a test module whose imports are missing here) do not hide the other modules' ids.
    errors = re.findall(r"^ERROR (\S+)", step.output, flags=re.MULTILINE)
    if step.status != "timed out":
        step.status = "passed" if ids else "failed"
    step.detail = f"{len(ids)} CUDA test ids" + (f"; modules that did not import: {', '.join(errors)}" if errors else "")
    return ids


def write_report(path: Path, steps: list[Step], *, started: float, budget: float, cuda: bool, environment: str) -> None:
    total = time.monotonic() - started
    lines = [
        "# gpu-check report",
        "",
        f"- when: {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}",
        f"- CUDA: {'yes' if cuda else 'no -- every GPU step skipped'}",
        f"- total: {total:.1f} s of a {budget:.0f} s budget",
        "",
        "```",
        environment.strip(),
        "```",
        "",
        "| step | status | seconds | limit | detail |",
        "|---|---|---|---|---|",
    ]
    lines += [f"| {s.name} | {s.status} | {s.seconds:.1f} | {s.limit:.0f} | {s.detail} |" for s in steps]
    for s in steps:
        if s.output.strip():
            lines += ["", f"## {s.name}: {s.status}", "", "```", tail(s.output), "```"]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    json_path = path.with_suffix(".json")
    json_path.write_text(json.dumps({"cuda": cuda, "total_s": round(total, 1), "budget_s": budget,
                                     "steps": [s.as_dict() for s in steps]}, indent=2))


def check(args: argparse.Namespace) -> int:
    started = time.monotonic()
    site = Path(args.site) if args.site else ROOT / ".gpu-site"
    path_entries = [str(ROOT)] + ([str(site)] if site.is_dir() else [])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path_entries + [os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
           "PYTHONUNBUFFERED": "1", "PYTHONDONTWRITEBYTECODE": "1"}
    steps: list[Step] = []

    def step(name: str) -> Step:
        left = args.budget - (time.monotonic() - started)
        made = Step(name, max(1.0, min(LIMITS[name], left)))
        steps.append(made)
        if left <= 1:
            made.status, made.detail = "not run", "the budget was spent"
        return made

    environment = step("environment")
    python_step(environment, (
        "import sys, importlib.util, torch, attn_course\n"
        "print('python', sys.version.split()[0], sys.executable)\n"
        "print('torch', torch.__version__, 'cuda build', torch.version.cuda, 'cuda available', torch.cuda.is_available())\n"
        "if torch.cuda.is_available(): print('gpu', torch.cuda.get_device_name(0))\n"
        "print('attn_course from', attn_course.__file__)\n"
        f"print('optional:', {{n: bool(importlib.util.find_spec(n)) for n in "
        f"('nbconvert', 'ipykernel', 'linear_attention_transformer', 'memory_efficient_attention_pytorch', 'local_attention')}})\n"
    ), env=env)
    cuda = "cuda available True" in environment.output
    if environment.status != "passed":
        environment.detail = "the interpreter cannot import torch and attn_course: nothing else can run"
        write_report(Path(args.report), steps, started=started, budget=args.budget, cuda=False, environment=environment.output)
        print(f"gpu-check: {environment.detail}; report: {args.report}")
        return 1
    if not cuda:
        print("gpu-check: no CUDA device here (see the report's environment): the GPU steps are skipped; "
              "rehearsing the parts that need no GPU", flush=True)

    scratch = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    try:
        collect = step("collect CUDA test ids")
        ids = collect_cuda_ids(collect, env=env) if collect.status == "not run" else []
        tests = step("pytest --device cuda")
        if not cuda:
            tests.status, tests.detail = "skipped", f"no CUDA ({len(ids)} CUDA test ids collected)"
        elif not ids:
            tests.status, tests.detail = "failed", "no CUDA test ids were collected"
        elif tests.status == "not run":
            run_command(tests, [sys.executable, "-m", "pytest", "--device", "cuda", "-q", "-p", "no:cacheprovider", *ids],
                        env=env)
            counts = re.findall(r"(\d+) (passed|failed|skipped|error|errors)", tests.output)
            tests.detail = ", ".join(f"{n} {what}" for n, what in counts) or tests.detail
        for lesson, name in zip(LESSONS, ("lesson 04 on cuda", "lesson 12 on cuda")):
            lesson_run = step(name)
            if lesson_run.status == "not run":
                lesson_step(lesson_run, lesson, env=env, cuda=cuda, scratch=scratch)
        cli = [sys.executable, "-m", "attn_course.cli", "bench"]
        for name, arguments in (("bench mha", ["mha"]), ("bench attention", ["attention"]), ("bench peers", ["peers"])):
            bench = step(name)
            if bench.status != "not run":
                continue
            if name == "bench peers":
                peers = has_modules(env, "linear_attention_transformer", "memory_efficient_attention_pytorch", "local_attention")
                if not peers:
                    bench.status, bench.detail = "skipped", "the peers are not installed (pip install 'attn-course[bench]', or bundle them: see --help)"
                    continue
            if not cuda:
                bench.status, bench.detail = "skipped", "no CUDA" + (" (the peers import)" if name == "bench peers" else "")
                continue
            code = run_command(bench, [*cli, *arguments, "--device", "cuda", "--json", str(scratch / f"{arguments[0]}.json")], env=env)
            if name == "bench peers" and code == 2 and "attn-course[bench]" in bench.output:
                bench.status, bench.detail = "skipped", "the peers are missing: " + tail(bench.output, 1)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    write_report(Path(args.report), steps, started=started, budget=args.budget, cuda=cuda, environment=environment.output)
    bad = [s for s in steps if s.status in ("failed", "timed out") or (s.status == "not run" and cuda)]
    total = time.monotonic() - started
    summary = ", ".join(f"{s.name}: {s.status}" for s in steps)
    print(f"gpu-check: {summary}; {total:.1f} s; report: {args.report}")
    return 1 if bad else 0


# ------------------------------------------------------------------------------------------ bundling the peers


def bundle(args: argparse.Namespace) -> int:
    """Copy the peer packages and their pure-Python requirements from this interpreter's site-packages."""
    from importlib import metadata

    target = Path(args.into)
    target.mkdir(parents=True, exist_ok=True)
    wanted, seen, copied = list(PEER_DISTRIBUTIONS), set(), []
    while wanted:
        name = wanted.pop()
        key = re.sub(r"[-_.]+", "-", name).lower()
        if key in seen or key in ON_THE_IMAGE:
            continue
        seen.add(key)
        try:
            distribution = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            print(f"bundle: {name} is not installed here: pip install 'attn-course[bench]' first", file=sys.stderr)
            return 2
        for requirement in distribution.requires or []:
            if "extra ==" not in requirement:
                wanted.append(re.split(r"[ ;<>=!~\[(]", requirement, maxsplit=1)[0])
        for file in distribution.files or []:
            if file.suffix in (".so", ".pyd"):
                print(f"bundle: {name} has compiled code ({file}); it cannot travel as source", file=sys.stderr)
                return 2
            if "__pycache__" in file.parts or str(file).startswith(".."):
                continue
            source = Path(file.locate())
            if source.is_file():
                destination = target / file
                destination.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(source, destination)
        copied.append(f"{distribution.metadata['Name']} {distribution.version}")
    size = sum(p.stat().st_size for p in target.rglob("*") if p.is_file())
    print(f"bundled into {target} ({size / 2**20:.2f} MiB): {', '.join(sorted(copied))}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gpu_check.py", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--report", default="gpu-check-report.md", help="the report to write (a .json beside it too)")
    parser.add_argument("--budget", type=float, default=480.0, help="seconds for every step together (default 480)")
    parser.add_argument("--site", default=None, help="a folder of bundled packages to put on PYTHONPATH (default .gpu-site/)")
    sub = parser.add_subparsers(dest="command")
    bundled = sub.add_parser("bundle", help="copy the peer packages from this interpreter into a folder that travels")
    bundled.add_argument("--into", default=str(ROOT / ".gpu-site"))
    runner = sub.add_parser("run-notebook", help="(internal) run a notebook's code cells in one namespace")
    runner.add_argument("path")
    rehearsal = sub.add_parser("rehearse-notebook", help="(internal) compile a notebook's cells, run its setup")
    rehearsal.add_argument("path")
    args = parser.parse_args(argv)
    if args.command == "bundle":
        return bundle(args)
    if args.command == "run-notebook":
        return run_notebook(Path(args.path))
    if args.command == "rehearse-notebook":
        return rehearse_notebook(Path(args.path))
    return check(args)


if __name__ == "__main__":
    sys.exit(main())
