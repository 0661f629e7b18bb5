"""The batch grader's sandbox: every attack of issue 14, and the ways around it, fail.

One folder of lesson-03 notebooks is graded twice by `attn-course grade` in a subprocess, with
`--jobs 2` and `--jobs 1`: clean solutions, an untouched exercise, and hostile notebooks (a solved
notebook plus attack cells, or an exercise plus one). Each attack cell raises `BLOCKED ...` when
the attack failed and `LEAK ...` when it worked, so the JSON's cell errors show that it ran and
what it saw; the host side is checked too (files that must not appear, processes that must be
gone, a process that must still live, a port nobody may reach). The clean notebooks graded after
and beside the attacks keep full marks, and the two runs write byte-identical CSVs.

These tests need bubblewrap: they fail in CI (CI=true) without it and skip elsewhere. The
hostile-data checks at the end need no sandbox (they feed the grader's reader directly).
"""

from __future__ import annotations

import copy
import csv
import io
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import nbformat
import pytest
import torch
from nbformat.v4 import new_code_cell, new_notebook

from attn_course import cli
from attn_course.grading import batch, runner, sandbox
from attn_course.grading.core import Outcome
from attn_course.grading.tasks import TASKS, tasks_for_lesson

ROOT = Path(__file__).resolve().parents[1]
SOLUTION = ROOT / "solutions" / "03_masking.ipynb"
EXERCISE = ROOT / "exercises" / "03_masking.ipynb"
LESSON_03 = [task.id for task in tasks_for_lesson("03")]  # causal_mask, padding_mask, masked_attention, cross_attention_mask (stretch)
FULL = sum(check.points for t in LESSON_03 for check in batch._failed_checks(TASKS[t], ""))
SECRET = "GRADER_TEST_SECRET_TOKEN"
SCRATCH_MB = 48


def require_sandbox() -> None:
    try:
        sandbox.check_available()
    except sandbox.SandboxUnavailable as exc:
        if os.environ.get("CI"):
            pytest.fail(f"CI must be able to make a bubblewrap sandbox (.ci/run installs it): {exc}")
        pytest.skip(f"no bubblewrap sandbox on this machine: {exc}")


# --- the attacks -----------------------------------------------------------------------------

REPORT = '''
def _report(attack, leaks):
    raise RuntimeError(("LEAK " if leaks else "BLOCKED ") + attack + (": " + "; ".join(map(str, leaks))[:200] if leaks else ""))
'''

# Reads of host files and folders that exist outside (checked by the test).
READ = '''
import glob, os
leaks = []
for path in C["read"]:
    try:
        if os.path.isdir(path):
            os.listdir(path)
        else:
            open(path, "rb").read(1)
        leaks.append(path)
    except OSError:
        pass
leaks += [p for pattern in C["globs"] for p in glob.glob(pattern)]
home = C["home"]
if os.path.isdir(home):  # only the folders that lead to the mounted Python may show
    leaks += [os.path.join(home, name) for name in os.listdir(home) if name not in C["home_allowed"]]
_report("read", leaks)
'''

# Writes next to attn_course/__init__.py, into the environment, the test's folders and home.
WRITE = '''
import os, sys, attn_course
targets = C["write"] + [os.path.join(os.path.dirname(attn_course.__file__), "_evil_inside.py"),
                        os.path.join(sys.prefix, "_evil_inside")]
leaks = []
for path in targets:
    try:
        with open(path, "w") as f:
            f.write("pwned")
        leaks.append(path)
    except OSError:
        pass
_report("write", leaks)
'''

# Through /proc/<pid>/root of every process it can see, and through a symlink out of scratch.
PROC_AND_LINKS = '''
import os
leaks = []
pids = [p for p in os.listdir("/proc") if p.isdigit()]
for pid in pids:
    for path in C["write"]:
        try:
            with open(f"/proc/{pid}/root{path}", "w") as f:
                f.write("pwned")
            leaks.append(f"/proc/{pid}/root{path}")
        except OSError:
            pass
os.symlink(C["read"][0], C["scratch"] + "/link")
try:
    open(C["scratch"] + "/link", "rb").read(1)
    leaks.append("read through a symlink")
except OSError:
    pass
for name in os.listdir(C["results"]):
    for attempt in (lambda: os.replace(C["scratch"] + "/link", f"{C['results']}/{name}"),
                    lambda: os.unlink(f"{C['results']}/{name}"),
                    lambda: os.symlink(C["read"][0], f"{C['results']}/{name}.link")):
        try:
            attempt()
            leaks.append(f"changed {name}")
        except OSError:
            pass
if len(pids) > 12:
    leaks.append(f"sees {len(pids)} processes")
_report(f"proc+links ({len(pids)} pids)", leaks)
'''

NETWORK_AND_ENV = '''
import os, socket
leaks = []
try:
    socket.create_connection(("127.0.0.1", C["port"]), timeout=3).close()
    leaks.append("connected to the host")
except OSError:
    pass
if C["secret"] in os.environ:
    leaks.append("saw the grader's environment")
if socket.gethostname() != "grading":
    leaks.append("host name " + socket.gethostname())
_report("network+env", leaks)
'''

# The first row, and other ways to signal outside: the grader is not in its namespace.
KILL = '''
import os, signal, subprocess
subprocess.run(["kill", "-9", str(os.getppid())])
tried = []
for pid in (C["sentinel"], 1, os.getppid()):
    try:
        os.kill(pid, signal.SIGKILL)
        tried.append(f"{pid}: no error")
    except OSError as exc:
        tried.append(f"{pid}: {exc.strerror}")
subprocess.run(["kill", "-9", str(C["sentinel"])], stderr=subprocess.DEVNULL)
_report("kill (" + ", ".join(tried) + ")", [])
'''

# Get out of the namespaces: join the first process's, or make new ones and write from there.
ESCAPE = '''
import ctypes, os, subprocess
leaks = []
libc = ctypes.CDLL(None, use_errno=True)
for kind in ("pid", "mnt", "net", "user"):
    try:
        fd = os.open(f"/proc/1/ns/{kind}", os.O_RDONLY)
    except OSError:
        continue
    if libc.setns(fd, 0) == 0 and kind != "pid":  # joining one's own pid namespace changes nothing
        leaks.append(f"setns {kind}")
    os.close(fd)
target = C["write"][0] + ".userns"
subprocess.run(["unshare", "-Urm", "sh", "-c", f"mount -o remount,rw /usr; echo x > {target}"],
               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
if os.path.exists(target):
    leaks.append(target)
_report("escape", leaks)
'''

# Leave processes behind (double fork + setsid, and a nested PID namespace) that try, for 20 s,
# to overwrite the results of whatever is graded next; fill the scratch disk.
DAEMON = '''
import os, subprocess, sys
code = """
import glob, sys, time
end = time.time() + 20
while time.time() < end:
    for pattern in sys.argv[2:]:
        for path in glob.glob(pattern):
            try:
                open(path, "wb").write(b"overwritten by a leftover process")
            except OSError:
                pass
    time.sleep(0.05)
"""
subprocess.run(["setsid", "-f", sys.executable, "-c", code, C["marker"], *C["results_globs"]])
subprocess.run(["setsid", "-f", "sleep", C["marker"]])
subprocess.run(["setsid", "-f", "unshare", "-Urpf", "sleep", C["marker"] + "1"], stderr=subprocess.DEVNULL)
_report("daemon started", [])
'''

FILL = '''
import errno, os
written = {}
for folder in (C["scratch"], "/tmp", os.path.expanduser("~"), "/dev/shm"):
    total = 0
    try:
        with open(os.path.join(folder, "fill"), "wb") as f:
            while total < 10 * C["scratch_mb"] * 2**20:
                f.write(b"x" * 2**20)
                f.flush()
                total += 2**20
    except OSError as exc:  # ENOSPC when full; EROFS for a /tmp that holds the Python environment
        written[folder] = (total // 2**20, errno.errorcode.get(exc.errno))
    if os.path.exists(os.path.join(folder, "fill")):
        os.remove(os.path.join(folder, "fill"))
leaks = [f"{folder}: {mb} MB" for folder, (mb, _) in written.items() if mb > C["scratch_mb"]]
leaks += [f"{folder}: no limit" for folder in (C["scratch"], "/dev/shm") if folder not in written]
_report("fill " + str(sorted(written.items())), leaks)
'''

SLEEP = "import time\ntime.sleep(4)  # the leftover processes act while the next notebook runs (--jobs 2)"

# Wait for the next submission: watch for 5 s for anything of another notebook.
WAIT = '''
import glob, os, time
# What this notebook's own process already wrote (PyTorch makes a torchinductor cache folder in
# $TMPDIR when some modules are imported) is its own; anything that appears while it waits is not.
seen, before = set(), set(glob.glob(C["scratch"] + "/*"))
end = time.time() + 5
while time.time() < end:
    for pattern in ["/sandbox/*", "/proc/*/root/sandbox/*", C["scratch"] + "/*", "/proc/*/cmdline"] + C["globs"]:
        seen.update(glob.glob(pattern))
    time.sleep(0.2)
own = {"/sandbox/cells.json", "/sandbox/results", C["scratch"]}
others = sorted(p for p in seen - before if p not in own and not p.startswith(("/proc/", C["scratch"] + "/.")))
pids = sorted({p.split("/")[2] for p in seen if p.startswith("/proc/") and p.endswith("cmdline")})
cmdlines = " ".join(open(f"/proc/{pid}/cmdline", "rb").read().decode(errors="replace") for pid in pids if os.path.exists(f"/proc/{pid}/cmdline"))
if "ipynb" in cmdlines or "carol" in cmdlines:
    others.append("another notebook's process")
_report(f"wait ({len(pids)} own pids)", others)
'''

# The second row: every callable in attn_course.grading and its submodules returns True.
PATCH_EVERYTHING = '''
import sys
for name, module in list(sys.modules.items()):
    if module is not None and (name == "attn_course.grading" or name.startswith("attn_course.grading.")):
        for attr, value in list(vars(module).items()):
            if callable(value):
                try:
                    setattr(module, attr, lambda *args, **kwargs: True)
                except (AttributeError, TypeError):
                    pass
'''

# Forge the result files: the runner's saver writes hostile payloads, one per task.
FORGE = '''
import gc, torch
[runner_globals] = [o for o in gc.get_objects() if type(o) is dict and "_Results" in o and "_save" in o]
real_save, payloads = runner_globals["_save"], []

def forged(record, buffer):
    n = len(record["outcomes"])
    kind = len(payloads)
    payloads.append(kind)
    if kind == 0:  # what the issue's patch produced: outcomes that are not dicts
        return real_save(dict(record, outcomes=[True] * n), buffer)
    if kind == 1:  # a tensor of 10**12 elements over one float: a memory bomb for the judge
        bomb = torch.zeros(1).expand(10**12)
        return real_save(dict(record, outcomes=[dict(o, returned=bomb) for o in record["outcomes"]]), buffer)
    buffer.write(b"PK" + b"\\xff" * (100 * 2**20))  # 100 MB: past the file-size limit

runner_globals["_save"] = forged
'''

ATTACK_CELLS = {
    "b_killer": [KILL],
    "c_spy": [READ, WRITE, PROC_AND_LINKS, NETWORK_AND_ENV, ESCAPE],
    "d_daemon": [DAEMON, FILL, SLEEP],
    "h_waiter": [WAIT],
}
CLEAN = {"a_alice": SOLUTION, "e_bob": SOLUTION, "i_carol": SOLUTION, "j_dave": EXERCISE}


def _with_cells(source: Path, path: Path, cells: list[str], constants: dict) -> None:
    """``source`` with ``cells`` added after its last code cell, each starting with the constants."""
    notebook = nbformat.read(source, as_version=4)
    header = f"C = {constants!r}\n{REPORT}\n"
    notebook.cells += [new_code_cell(header + cell) for cell in cells]
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(notebook, path)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _processes_with(marker: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = entry.joinpath("cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if marker in cmdline and _alive(int(entry.name)):
                found.append(int(entry.name))
    return found


def _grade(folder: Path, out: Path, jobs: int, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "attn_course.cli", "grade", str(folder), "--csv", str(out / f"jobs{jobs}.csv"),
         "--json", str(out / f"jobs{jobs}.json"), "--jobs", str(jobs), "--scratch-mb", str(SCRATCH_MB)],
        env=env, capture_output=True, text=True, timeout=600,
    )


@pytest.fixture(scope="module")
def attacked(tmp_path_factory):
    """The folder graded with --jobs 2, then --jobs 1; the host checked after each run."""
    require_sandbox()
    base = tmp_path_factory.mktemp("attacks")
    folder, out, outside = base / "submissions", base / "out", base / "outside"
    out.mkdir()
    outside.mkdir()
    secret_file = outside / "secret.txt"
    secret_file.write_text("the instructor's notes")
    home = Path.home()
    env_paths = sandbox.environment_paths()
    listener = socket.create_server(("127.0.0.1", 0))
    listener.setblocking(False)
    sentinel = subprocess.Popen(["sleep", "600"])
    marker = f"{700 + os.getpid() % 1000}.5"
    constants = {
        "read": [str(folder / "a_alice" / "03_masking.ipynb"), str(folder), str(secret_file), str(SOLUTION),
                 str(ROOT / "README.md"), "/etc/shadow", "/etc/passwd", "/etc/hostname"]
                + [str(home / name) for name in (".bashrc", ".profile", ".gitconfig", ".ssh") if (home / name).exists()],
        "globs": [str(folder / "*"), str(Path(os.environ.get("TMPDIR", "/tmp")) / "attn-course-grade-*"),
                  "/tmp/attn-course-grade-*", str(ROOT / "solutions" / "*"), str(ROOT / "tests" / "*")],
        "home": str(home),
        "home_allowed": sorted({Path(p).relative_to(home).parts[0] for p in env_paths if Path(p).is_relative_to(home)}),
        "write": [str(ROOT / "attn_course" / "_evil.py"), str(outside / "_evil"), str(home / "_attn_course_evil"),
                  str(Path(torch.__file__).parent / "_evil.py"), str(Path(sys.prefix) / "_evil")],
        "port": listener.getsockname()[1],
        "secret": SECRET,
        "sentinel": sentinel.pid,
        "marker": marker,
        "results_globs": ["/tmp/attn-course-grade-*/results/*", "/sandbox/../tmp/attn-course-grade-*/results/*"],
        "scratch": sandbox.SCRATCH,
        "results": sandbox.RESULTS,
        "scratch_mb": SCRATCH_MB,
    }
    for name, source in CLEAN.items():
        _with_cells(source, folder / name / "03_masking.ipynb", [], constants)
    for name, cells in ATTACK_CELLS.items():
        _with_cells(SOLUTION, folder / name / "03_masking.ipynb", cells, constants)
    _with_cells(EXERCISE, folder / "f_patcher" / "03_masking.ipynb", [PATCH_EVERYTHING], constants)
    _with_cells(SOLUTION, folder / "g_forger" / "03_masking.ipynb", [FORGE], constants)
    assert all(os.path.exists(p) for p in constants["read"]), "the files to steal exist outside"

    env = dict(os.environ, **{SECRET: "hunter2"})
    runs = {}
    try:
        for jobs in (2, 1):
            done = _grade(folder, out, jobs, env)
            leftovers = _processes_with(marker)
            for pid in leftovers:
                os.kill(pid, signal.SIGKILL)
            with open(out / f"jobs{jobs}.csv", newline="") as f:
                rows = list(csv.DictReader(f))
            runs[jobs] = {
                "done": done,
                "leftovers": leftovers,
                "sentinel_alive": sentinel.poll() is None,
                "csv": (out / f"jobs{jobs}.csv").read_bytes(),
                "rows": rows,
                "json": {s["student"]: s for s in json.loads((out / f"jobs{jobs}.json").read_text())["submissions"]},
            }
        try:
            listener.accept()
            connected = True
        except BlockingIOError:
            connected = False
        evil = [p for p in constants["write"] + [constants["write"][0] + ".userns"] if os.path.exists(p)]
        for path in evil:
            os.remove(path)
    finally:
        sentinel.kill()
        sentinel.wait()
        listener.close()
    return {"runs": runs, "connected": connected, "evil": evil, "constants": constants}


@pytest.fixture(scope="module", params=[2, 1], ids=["jobs2", "jobs1"])
def run(request, attacked):
    return attacked["runs"][request.param]


def _cell_reports(run, student: str) -> list[str]:
    return [e["error"] for e in run["json"][student]["cell_errors"]]


def test_the_grader_survives_and_writes_every_row_in_order(run):
    assert run["done"].returncode == 0, run["done"].stderr[-2000:]
    students = sorted({*CLEAN, *ATTACK_CELLS, "f_patcher", "g_forger"})
    assert [row["student"] for row in run["rows"]] == [s for s in students for _ in LESSON_03]
    assert [row["task"] for row in run["rows"]] == LESSON_03 * len(students)
    assert {row["sandbox"] for row in run["rows"]} == {"bwrap"}


def test_clean_notebooks_before_beside_and_after_the_attacks_keep_full_marks(run):
    for student in ("a_alice", "e_bob", "i_carol"):
        sub = run["json"][student]
        assert (sub["score"], sub["max_score"]) == (FULL, FULL), sub["tasks"]
        assert sub["cell_errors"] == []
    dave = [row for row in run["rows"] if row["student"] == "j_dave"]
    assert [(row["status"], float(row["score"])) for row in dave] == [("graded", 0.0)] * len(LESSON_03)
    assert all("not implemented yet" in row["feedback"] for row in dave)


def test_attacks_that_failed_cost_their_notebook_nothing(run):
    for student in ATTACK_CELLS:
        sub = run["json"][student]
        assert (sub["score"], sub["max_score"]) == (FULL, FULL), (student, sub["tasks"])
        reports = _cell_reports(run, student)
        assert reports and all(r.startswith("RuntimeError: BLOCKED") for r in reports), (student, reports)


def test_nothing_outside_can_be_read_or_written(run, attacked):
    reports = _cell_reports(run, "c_spy")
    assert [r.split()[2] for r in reports] == ["read", "write", "proc+links", "network+env", "escape"], reports
    assert attacked["evil"] == []  # no file appeared next to attn_course/__init__.py, in torch, home...
    assert not attacked["connected"]  # nothing reached the host's port


def test_the_grader_and_other_processes_cannot_be_signalled(run):
    assert run["sentinel_alive"]
    [report] = _cell_reports(run, "b_killer")
    assert "BLOCKED kill" in report


def test_left_behind_processes_die_with_their_notebook(run):
    assert run["leftovers"] == []  # the double-forked daemon, `sleep`, and one in a nested PID namespace
    reports = _cell_reports(run, "d_daemon")
    assert reports[0].startswith("RuntimeError: BLOCKED daemon started")


def test_filling_the_disk_stops_at_the_scratch_size(run):
    [fill] = [r for r in _cell_reports(run, "d_daemon") if "BLOCKED fill" in r]
    assert f"'{sandbox.SCRATCH}'" in fill and "ENOSPC" in fill and "'/dev/shm'" in fill


def test_a_notebook_waiting_for_the_next_one_sees_nothing_of_it(run):
    [report] = _cell_reports(run, "h_waiter")
    assert report.startswith("RuntimeError: BLOCKED wait")


def test_replacing_every_grading_callable_costs_only_that_notebook(run):
    # Which part of the child breaks first depends on the grading code it patched: either it
    # saves garbage (the TypeError in Outcome.from_plain, now a malformed record) or it
    # fails while saving. Either way: that notebook's rows are crashed, the batch goes on.
    rows = [row for row in run["rows"] if row["student"] == "f_patcher"]
    assert [(row["status"], float(row["score"])) for row in rows] == [("crashed", 0.0)] * len(LESSON_03)
    assert all("could not be read back (malformed" in row["feedback"] or "failed in the notebook's process"
               in row["feedback"] for row in rows), rows


def test_forged_result_files_become_crashed_rows(run):
    rows = {row["task"]: row for row in run["rows"] if row["student"] == "g_forger"}
    assert {(row["status"], float(row["score"])) for row in rows.values()} == {("crashed", 0.0)}
    causal, padding, masked = (rows[f"03.{t}"]["feedback"] for t in ("causal_mask", "padding_mask", "masked_attention"))
    assert "an outcome is not a dict" in causal
    assert "a tensor larger than its data" in padding
    assert "File too large" in masked  # the runner's write hit RLIMIT_FSIZE


def test_jobs_1_and_2_write_byte_identical_grades(attacked):
    assert attacked["runs"][1]["csv"] == attacked["runs"][2]["csv"]


# --- Ctrl-C ----------------------------------------------------------------------------------


def test_ctrl_c_kills_the_running_notebooks_and_writes_the_rows_finished_so_far(tmp_path):
    require_sandbox()
    marker = f"{800 + os.getpid() % 1000}.5"
    folder = tmp_path / "class"
    _with_cells(SOLUTION, folder / "a_fast" / "03_masking.ipynb", [], {})
    slow = f"import subprocess, time\nsubprocess.run(['setsid', '-f', 'sleep', '{marker}'])\ntime.sleep(600)"
    for name in ("b_slow", "c_slow"):
        _with_cells(SOLUTION, folder / name / "03_masking.ipynb", [slow], {})
    out_csv = tmp_path / "grades.csv"
    proc = subprocess.Popen([sys.executable, "-m", "attn_course.cli", "grade", str(folder), "--jobs", "2",
                             "--csv", str(out_csv), "--json", str(tmp_path / "grades.json")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        lines = []
        while not any(line.startswith("[1/3]") for line in lines):  # the fast one is done
            line = proc.stderr.readline()
            assert line, f"the grader ended early: {''.join(lines)}"
            lines.append(line)
        deadline = time.time() + 60
        while len(_processes_with(f"sleep {marker}")) < 2 and time.time() < deadline:
            time.sleep(0.2)  # both slow notebooks are running
        assert len(_processes_with(f"sleep {marker}")) == 2
        start = time.perf_counter()
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=60)
        assert time.perf_counter() - start < 20
    finally:
        proc.kill()
    assert proc.returncode == 130, stderr
    assert "interrupted: 1 of 3 notebooks graded" in stderr
    with open(out_csv, newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(row["student"], row["status"]) for row in rows] == [("a_fast", "graded")] * len(LESSON_03)
    assert json.loads((tmp_path / "grades.json").read_text())["settings"]["interrupted"] is True
    assert _processes_with(f"sleep {marker}") == []


# --- no sandbox: refused, unless asked for ---------------------------------------------------


def _notebook(path: Path, *sources: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(new_notebook(cells=[new_code_cell(s) for s in sources]), path)
    return path


CAUSAL = "import torch\ndef causal_mask(L, S):\n    return torch.ones(L, S, dtype=torch.bool).tril()"


@pytest.mark.parametrize("missing", ["bwrap", "a recent bwrap", "user namespaces", "Linux"])
def test_without_a_sandbox_grading_is_refused_with_the_fix(tmp_path, capsys, monkeypatch, missing):
    notebook = _notebook(tmp_path / "03_x.ipynb", CAUSAL)
    monkeypatch.setattr(sandbox.sys, "platform", "darwin" if missing == "Linux" else "linux")
    monkeypatch.setattr(sandbox.shutil, "which", lambda name: None if missing == "bwrap" else "/usr/bin/bwrap")
    options = set(sandbox._REQUIRED_OPTIONS) - ({"--size"} if missing == "a recent bwrap" else set())
    monkeypatch.setattr(sandbox, "_bwrap_options", lambda bwrap="bwrap": frozenset(options))
    monkeypatch.setattr(sandbox, "_probe", lambda bwrap, root: "bwrap: No permissions to create new namespace")
    fix = {
        "bwrap": "apt-get install bubblewrap",
        "a recent bwrap": "install a newer bubblewrap",
        "user namespaces": "run attn-course grade as a normal user" if sandbox.runs_as_root() else "unprivileged_userns_clone",
        "Linux": "Linux virtual machine",
    }[missing]
    assert cli.main(["grade", str(notebook), "--csv", str(tmp_path / "g.csv")]) == 2
    err = capsys.readouterr().err
    assert "none can be made here" in err and fix in err and "--sandbox off" in err
    assert not (tmp_path / "g.csv").exists()
    with pytest.raises(sandbox.SandboxUnavailable):
        batch.grade_notebook(notebook)


def test_sandbox_off_grades_and_every_row_says_so(tmp_path, capsys):
    notebook = _notebook(tmp_path / "03_x.ipynb", CAUSAL)
    out_csv, out_json = tmp_path / "g.csv", tmp_path / "g.json"
    assert cli.main(["grade", str(notebook), "--tasks", "03.causal_mask", "--sandbox", "off",
                     "--csv", str(out_csv), "--json", str(out_json)]) == 0
    captured = capsys.readouterr()
    assert "WARNING: grading WITHOUT a sandbox" in captured.err
    assert "WARNING: graded WITHOUT a sandbox" in captured.out
    with open(out_csv, newline="") as f:
        [row] = list(csv.DictReader(f))
    assert (row["status"], row["score"], row["sandbox"]) == ("graded", "3.0", "off")
    data = json.loads(out_json.read_text())
    assert data["submissions"][0]["sandbox"] == "off" and data["settings"]["sandbox"] == "off"


def test_the_sandbox_command_mounts_only_what_python_needs(tmp_path):
    cells, result = tmp_path / "cells.json", tmp_path / "r.pt"
    argv = sandbox.command(["python"], cells=cells, results={"r.pt": result}, scratch_mb=64, info_fd=9)
    pairs = {(argv[i], argv[i + 1], argv[i + 2]) for i in range(len(argv) - 2)}
    for flag in ("--unshare-pid", "--unshare-net", "--die-with-parent", "--new-session"):
        assert flag in argv
    read_only = {argv[i + 1] for i in range(len(argv) - 1) if argv[i] == "--ro-bind"} - set(sandbox._TOP_LEVEL)
    assert read_only == {*sandbox.environment_paths(), str(cells)}
    assert not any(path in ("/", "/home", "/root", "/tmp", "/run", "/var", str(Path.home())) for path in read_only)
    writable = [(argv[i + 1], argv[i + 2]) for i in range(len(argv) - 2) if argv[i] == "--bind"]
    assert writable == [(str(result), f"{sandbox.RESULTS}/r.pt")]  # one file, nothing else of the host
    assert ("--size", str(64 * 2**20), "--tmpfs") in pairs
    assert argv[argv.index("--remount-ro") + 1] == "/"
    with pytest.raises(ValueError, match="plain file name"):
        sandbox.command(["python"], cells=cells, results={"../x": result}, scratch_mb=64)


# --- hostile result files, fed to the reader directly (no sandbox needed) ----------------------

TASK = TASKS["03.causal_mask"]


def _saved(record) -> bytes:
    buffer = io.BytesIO()
    torch.save(record, buffer)
    return buffer.getvalue()


def _good_record() -> dict:
    cases = TASK.make_cases()
    outcomes = [Outcome(returned=TASK.reference(*case.args, **case.kwargs), args_after=case.args).to_plain()
                for case in cases]
    return {"format": runner.FORMAT, "task": TASK.id, "defined": True, "callable": True, "type_name": "function",
            "outcomes": outcomes}


def _row_for(data: bytes | str, status: dict | None = None) -> batch.GradeRow:
    run = batch._ChildRun(0, False, status if status is not None else {"stage": "done"},
                          {runner.result_name(TASK.id): data}, 1.0)
    return batch._judge_task(Path("x/03_masking.ipynb"), TASK, run, timeout_s=120, memory_mb=4096)


def test_a_good_record_is_graded():
    row = _row_for(_saved(_good_record()))
    assert (row.status, row.score, row.max_score) == ("graded", 3.0, 3.0)


def _deep(depth: int):
    value = []
    for _ in range(depth):
        value = [value]
    return value


def _malformed_records():
    good = _good_record()
    outcome = good["outcomes"][0]
    yield "not a dict", [1, 2, 3]
    yield "wrong format", dict(good, format=2)
    yield "another task", dict(good, task="03.padding_mask")
    yield "defined is a str", dict(good, defined="yes")
    yield "outcomes of bools", dict(good, outcomes=[True] * len(good["outcomes"]))
    yield "error is a tensor", dict(good, outcomes=[dict(outcome, error=torch.zeros(1))] * len(good["outcomes"]))
    yield "args_after is a bool", dict(good, outcomes=[dict(outcome, args_after=True)] * len(good["outcomes"]))
    yield "too deep", dict(good, outcomes=[dict(outcome, returned=_deep(100))] * len(good["outcomes"]))
    yield "too many values", dict(good, extra=list(range(200_000)))
    yield "huge int", dict(good, outcomes=[dict(outcome, returned=10**2000)] * len(good["outcomes"]))
    yield "int dict keys", dict(good, extra={1: 2})
    yield "stride-0 bomb", dict(good, outcomes=[dict(outcome, returned=torch.zeros(1).expand(10**12))] * len(good["outcomes"]))
    yield "a parameter", dict(good, outcomes=[dict(outcome, returned=torch.nn.Parameter(torch.zeros(2)))] * len(good["outcomes"]))
    yield "requires grad", dict(good, extra=torch.zeros(2, requires_grad=True))
    yield "sparse", dict(good, extra=torch.zeros(3, 3).to_sparse())
    yield "a dtype", dict(good, extra=torch.float32)
    yield "a set", dict(good, extra={1, 2})
    yield "bytes", dict(good, extra=b"\x00" * 10)
    yield "a torch.Size", dict(good, extra=torch.Size([2, 3]))


@pytest.mark.parametrize(("what", "record"), list(_malformed_records()), ids=[w for w, _ in _malformed_records()])
def test_malformed_records_become_crashed_rows(what, record):
    row = _row_for(_saved(record))
    assert (row.status, row.score, row.max_score) == ("crashed", 0.0, 3.0), (what, row.feedback)
    assert "could not be read back" in row.feedback


def test_unknown_keys_holding_plain_values_are_allowed():
    record = _good_record()
    record["outcomes"] = [dict(o, probe={"largest": 12, "calls": ["aten::mm"]}) for o in record["outcomes"]]
    assert _row_for(_saved(dict(record, extra={"note": [1, 2.5, None, "x"]}))).status == "graded"


def test_garbage_bytes_and_bombs_become_crashed_rows():
    good = _saved(_good_record())
    compressed = io.BytesIO()
    with zipfile.ZipFile(compressed, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("archive/data.pkl", b"\0" * 10**7)  # 10 MB in a few kB
    cases = [b"not a zip", b"PK\x03\x04" + b"\xff" * 1000, good[: len(good) // 2], compressed.getvalue(),
             "it is too large (70000000 bytes; the limit is 67108864)"]
    for data in cases:
        row = _row_for(data)
        assert (row.status, row.score) == ("crashed", 0.0)
        assert "could not be read back" in row.feedback


def test_no_byte_flip_of_a_result_file_raises_in_the_grader():
    good = _saved(_good_record())
    rng = random.Random(14)
    statuses = set()
    for _ in range(300):
        data = bytearray(good)
        for _ in range(rng.randint(1, 8)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        row = _row_for(bytes(data))  # must return, whatever the bytes
        assert row.status in ("graded", "crashed") and row.max_score == 3.0
        statuses.add(row.status)
    assert "crashed" in statuses  # flips in ignored zip padding leave it graded; the others are caught


@pytest.mark.parametrize("status", [
    {"fatal": ["not", "a", "str"], "task_errors": ["x"], "cell_errors": "nope"},
    {"task_errors": {TASK.id: {"deep": [1]}}, "cell_errors": [{"cell": "2", "error": 3}, None, 7]},
    {"task_errors": {TASK.id: "MemoryError \x1b[2J" + "x" * 10**5}},
])
def test_a_hostile_runner_json_costs_only_its_notebook(status):
    row = _row_for(b"", status)  # no results: the status explains why
    assert row.status in ("crashed", "memory") and row.score == 0.0
    assert "\x1b" not in row.feedback and len(row.feedback) < 1000
    assert batch._cell_errors(status) == []


def test_text_from_a_submission_is_made_printable_and_formula_free():
    assert batch._printable("ok\n\tfine\x1b[31mred\x07\u202e") == "ok\n\tfine\\x1b[31mred\\x07\\u202e"
    assert len(batch._printable("x" * 10_000)) == batch._MAX_MESSAGE
    row = batch.GradeRow("=cmd|' /C calc'!A0.ipynb", "=HYPERLINK(1)", "03.causal_mask", 0.0, 3.0, "crashed", "+1")
    assert row.csv_row()["student"] == "'=HYPERLINK(1)" and row.csv_row()["feedback"] == "'+1"
    assert row.csv_row()["score"] == 0.0


def test_the_progress_bar_counts_done_failed_and_time_left():
    def result(status: str) -> batch.SubmissionResult:
        row = batch.GradeRow("s.ipynb", "s", "03.causal_mask", 0.0, 3.0, status, "")
        return batch.SubmissionResult("s.ipynb", "s", [row], seconds=1.0)

    stream = io.StringIO()
    bar = batch.ProgressBar(stream, tty=True, width=10)
    bar.start(4, 2)
    assert "[..........] 0/4 notebooks, 0 failed, ? left" in stream.getvalue()
    bar.started -= 9.5  # about 10 s for the first two: about 10 s left for the other two
    bar.advance(result("graded"))
    bar.advance(result("timeout"))
    text = stream.getvalue()
    assert "FAILED s.ipynb: 1 timeout\n" in text
    assert text.endswith("[#####.....] 2/4 notebooks, 1 failed, about 0:10 left")
    bar.close(interrupted=True)
    assert stream.getvalue().endswith("interrupted: 2 of 4 notebooks graded in 0:10, 1 failed\n")
    log = io.StringIO()
    plain = batch.ProgressBar(log, tty=False)
    plain.start(1, 1)
    plain.advance(result("graded"))
    assert log.getvalue() == "[1/1] s.ipynb: 0/3 (1 graded; 1.0 s) | 0 failed, done\n"
    assert batch._clock(3725) == "1:02:05" and batch._clock(59.2) == "1:00"


def test_a_notebook_the_grader_cannot_start_costs_only_its_rows(tmp_path, monkeypatch):
    def cannot_start(*args, **kwargs):
        raise OSError("no such file: bwrap")

    notebook = _notebook(tmp_path / "03_x.ipynb", CAUSAL)
    monkeypatch.setattr(batch, "_run_child", cannot_start)
    [result] = batch.grade_batch([notebook], sandbox="off", task_ids=["03.causal_mask"])
    [row] = result.rows
    assert (row.status, row.score, row.max_score) == ("crashed", 0.0, 3.0)
    assert "OSError: no such file: bwrap" in row.feedback


@pytest.mark.parametrize("kind", ["deep JSON", "source of numbers", "symlink", "fifo", "too large"])
def test_a_hostile_notebook_file_is_unreadable_not_a_crash(tmp_path, monkeypatch, kind):
    classmate = _notebook(tmp_path / "alice" / "03_masking.ipynb", CAUSAL)
    path = tmp_path / "bob" / "03_masking.ipynb"
    path.parent.mkdir()
    if kind == "deep JSON":
        path.write_text('{"cells": ' + "[" * 100_000 + "]" * 100_000 + "}")
    elif kind == "source of numbers":
        path.write_text(json.dumps({"cells": [{"cell_type": "code", "source": [1, 2]}]}))
    elif kind == "symlink":  # bob hands in alice's work
        path.symlink_to(classmate)
    elif kind == "fifo":  # reading it would wait forever
        os.mkfifo(path)
    else:
        monkeypatch.setattr(batch, "_MAX_NOTEBOOK_BYTES", 100)
        path.write_bytes(classmate.read_bytes())
    rows = batch.grade_notebook(path, sandbox="off").rows  # no child starts: the file is refused first
    assert [(row.status, row.score) for row in rows] == [("unreadable", 0.0)] * len(LESSON_03)
    assert {"symlink": "a symbolic link", "fifo": "not a regular file", "too large": "too large"}.get(kind, "") in rows[0].feedback


def test_stretch_tasks_are_counted_apart_in_every_output(tmp_path):
    core_task, stretch_task = TASKS["03.causal_mask"], copy.copy(TASKS["03.padding_mask"])
    object.__setattr__(stretch_task, "stretch", True)  # what a stretch task says (Task.stretch)
    path = Path("alice/03_masking.ipynb")
    rows = [batch._zero_row(path, core_task, "graded", "wrong"), batch._zero_row(path, stretch_task, "graded", "wrong")]
    rows[0].score = 2.0
    result = batch.SubmissionResult(str(path), "alice", rows)
    assert (result.totals(stretch=False), result.totals(stretch=True)) == ((2.0, 3.0), (0.0, 3.0))
    batch.write_csv([result], tmp_path / "g.csv")
    with open(tmp_path / "g.csv", newline="") as f:
        assert [(r["task"], r["stretch"]) for r in csv.DictReader(f)] == [(core_task.id, "False"), (stretch_task.id, "True")]
    batch.write_json([result], tmp_path / "g.json")
    [sub] = json.loads((tmp_path / "g.json").read_text())["submissions"]
    assert (sub["core_score"], sub["core_max_score"], sub["stretch_score"], sub["stretch_max_score"]) == (2, 3, 0, 3)
    assert (sub["score"], sub["max_score"]) == (2, 6)
    table = batch.summary_table([result])
    assert "03.padding_mask  stretch  0/3" in table and "03.causal_mask   core     2/3" in table
    assert "alice    2/3   0/3      alice/03_masking.ipynb" in table  # core and stretch totals


def test_an_environment_under_tmp_keeps_tmp_and_one_under_the_sandbox_folders_is_refused(tmp_path, monkeypatch):
    cells, result = tmp_path / "cells.json", tmp_path / "r.pt"
    monkeypatch.setattr(sandbox, "environment_paths", lambda: ["/usr", "/tmp/ci/venv"])
    argv = sandbox.command(["python"], cells=cells, results={"r.pt": result}, scratch_mb=64)
    assert ("--ro-bind", "/tmp/ci/venv") == tuple(argv[argv.index("/tmp/ci/venv") - 1:argv.index("/tmp/ci/venv") + 1])
    assert "/tmp" not in [argv[i + 2] for i in range(len(argv) - 2) if argv[i] == "--symlink"]
    monkeypatch.setattr(sandbox, "environment_paths", lambda: ["/usr", f"{sandbox.ROOT}/venv"])
    with pytest.raises(sandbox.SandboxUnavailable, match="install the course elsewhere"):
        sandbox.command(["python"], cells=cells, results={"r.pt": result}, scratch_mb=64)
