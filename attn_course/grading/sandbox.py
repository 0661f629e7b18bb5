"""A bubblewrap sandbox for the batch grader's child process: one per submitted notebook.

``attn-course grade`` runs each notebook's cells in ``attn_course.grading.runner``; this module
builds the ``bwrap`` command around that process (bubblewrap, the Debian package
``bubblewrap``: the sandbox Flatpak uses). Inside it the child has

- its own PID namespace: it sees only its own processes, cannot signal the grader or anything
  else on the machine, and every process it starts dies with it (when the namespace's first
  process ends, the kernel kills the rest; the grader ends it after the notebook);
- its own network (loopback only), IPC and hostname namespaces;
- a read-only view of just what Python needs (``/usr``, the Python installation and its
  site-packages, the ``attn_course`` package, the dynamic loader's cache), mounted at the same
  paths as outside, with nothing else of the host: no ``/home``, ``/root``, ``/tmp``, ``/run``
  (no daemon sockets), no other submission and no grader work folder;
- one writable folder, ``/sandbox/scratch`` (also ``$HOME``, ``$TMPDIR`` and ``/tmp``): a fresh
  in-memory filesystem of ``scratch_mb`` megabytes that vanishes with the sandbox;
- its results: ``/sandbox/results/<name>``, files the grader created empty before it started,
  each bind-mounted writable on its own (the folder around them is read-only, so nothing can be
  added, renamed or replaced by a symlink); the grader reads them once the namespace is gone;
- no capabilities. Run by an ordinary user, bwrap puts the child in a new user namespace and
  forbids it to make more. Run as root, bwrap sets up the mounts with root's rights and the
  runner then drops to an unused user id of its own (``uid_for_slot``) before it reads a cell,
  so the notebook is never root, not even a capability-less root that owns every file.

The environment is a short allow-list (``child_env``): locale, thread settings, and the paths
the runner needs; nothing else of the grader's environment (tokens, SSH agent) reaches it.

Where no sandbox can be made (not Linux, bwrap missing, user namespaces disabled),
``check_available`` raises ``SandboxUnavailable`` with the fix. Taught in lesson 00.
"""

from __future__ import annotations

import functools
import os
import pwd
import shutil
import site
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path

__all__ = [
    "SCRATCH",
    "CELLS",
    "RESULTS",
    "SandboxUnavailable",
    "check_available",
    "command",
    "child_env",
    "uid_for_slot",
    "runs_as_root",
]

ROOT = "/sandbox"  # the sandbox's own folders, inside; nothing of the host may lie there
SCRATCH = f"{ROOT}/scratch"  # the only writable folder inside
CELLS = f"{ROOT}/cells.json"  # read-only inside
RESULTS = f"{ROOT}/results"  # a read-only folder of writable files
HOSTNAME = "grading"
SHM_MB = 16  # /dev/shm: enough for multiprocessing's semaphores, not a second scratch disk
# Top-level links of a merged-/usr system (/bin -> usr/bin ...) are recreated as links.
_TOP_LEVEL = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
# What the dynamic loader and Python's standard library read from /etc; nothing with secrets.
_ETC_FILES = ("/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/localtime")
# Passed through to the child when set: they change how torch computes, not what it may reach.
_ENV_NAMES = ("LANG", "LC_ALL", "LC_CTYPE", "LC_NUMERIC", "TZ", "PYTHONHASHSEED", "ATTN_COURSE_THREADS",
              "ATTN_COURSE_DEVICE")
_ENV_PREFIXES = ("OMP_", "MKL_", "OPENBLAS_", "KMP_", "GOMP_", "ATEN_", "TORCH_", "PYTORCH_")
# Root mode: each parallel job runs as its own unused uid, from the block Debian's policy
# reserves (65000-65533, below nobody), so one job's processes never count against another's.
_UID_TOP = 65533
_UID_BOTTOM = 65000


class SandboxUnavailable(RuntimeError):
    """No sandbox can be made on this machine; the message says why and how to fix it."""


def runs_as_root() -> bool:
    return hasattr(os, "geteuid") and os.geteuid() == 0


@functools.lru_cache(maxsize=None)
def _free_uids() -> tuple[int, ...]:
    """Unused uids of the reserved block, highest first (a uid with a passwd entry is skipped)."""
    free = []
    for uid in range(_UID_TOP, _UID_BOTTOM - 1, -1):
        try:
            pwd.getpwuid(uid)
        except KeyError:
            free.append(uid)
    return tuple(free)


def uid_for_slot(slot: int) -> int:
    """The uid job ``slot`` (0, 1, ...) runs as when the grader is root."""
    free = _free_uids()
    if not 0 <= slot < len(free):
        raise ValueError(f"no unused uid for parallel job {slot}: at most {len(free)} jobs when grading as root")
    return free[slot]


@functools.lru_cache(maxsize=None)
def _bwrap_options(bwrap: str = "bwrap") -> frozenset[str]:
    """The options this bwrap knows (they grew over releases: ``--size`` and ``--disable-userns``
    are recent), read from ``bwrap --help``; empty when it cannot be run."""
    try:
        done = subprocess.run([bwrap, "--help"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return frozenset()
    return frozenset(word for word in (done.stdout + done.stderr).split() if word.startswith("--"))


_REQUIRED_OPTIONS = ("--size", "--perms", "--info-fd", "--block-fd", "--die-with-parent", "--cap-drop", "--remount-ro")


def _existing(paths: Iterable[str]) -> list[str]:
    """Each path as given and resolved (a venv is found through the path it was made with), if it exists."""
    found = []
    for path in paths:
        if path and os.path.exists(path):
            found += [os.path.abspath(path), os.path.realpath(path)]
    return found


def environment_paths() -> list[str]:
    """The host folders the child reads: Python, its site-packages and the ``attn_course`` package.

    Each is mounted read-only at its own path; one inside another is mounted once. ``/usr`` and
    the loader's files in ``/etc`` are added by ``command``.
    """
    package = Path(__file__).resolve().parents[1]  # .../attn_course
    candidates = [sys.prefix, sys.exec_prefix, sys.base_prefix, sys.base_exec_prefix,
                  os.path.dirname(sys.executable), str(package)]
    candidates += site.getsitepackages() if hasattr(site, "getsitepackages") else []
    user_site = site.getusersitepackages() if site.ENABLE_USER_SITE else ""
    if user_site and user_site in sys.path:  # packages installed with pip --user
        candidates.append(user_site)
    return _outermost(["/usr", *_existing(candidates)])


def _under(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip("/") + "/")


def _outermost(paths: Iterable[str]) -> list[str]:
    """The paths that are not inside another one of them, sorted."""
    kept: list[str] = []
    for path in sorted(set(paths), key=lambda p: (p.count("/"), p)):
        if path != "/" and not any(_under(path, k) for k in kept):
            kept.append(path)
    return sorted(kept)


def child_env(*, package_parent: str, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The child's whole environment: an allow-list of the grader's, plus the paths it needs."""
    env = {name: value for name, value in os.environ.items()
           if name in _ENV_NAMES or name.startswith(_ENV_PREFIXES)}
    env.update(
        PATH=os.pathsep.join([os.path.dirname(sys.executable), "/usr/local/bin", "/usr/bin", "/bin"]),
        HOME=SCRATCH,
        TMPDIR=SCRATCH,
        MPLBACKEND="Agg",
        MPLCONFIGDIR=f"{SCRATCH}/.config/matplotlib",
        IPYTHONDIR=f"{SCRATCH}/.ipython",
        PYTHONPATH=package_parent,
        PYTHONDONTWRITEBYTECODE="1",
    )
    env.update(extra or {})
    return env


def command(inner: list[str], *, cells: Path, results: Mapping[str, Path], scratch_mb: int,
            info_fd: int | None = None, block_fd: int | None = None) -> list[str]:
    """The ``bwrap`` command line that runs ``inner`` in a fresh sandbox.

    Args:
        inner: the command to run inside (paths as seen inside).
        cells: host file mounted read-only at ``CELLS``.
        results: ``{name: host file}``, each mounted writable at ``RESULTS/name``; the files
            must exist (the grader creates them empty).
        scratch_mb: size of the in-memory ``SCRATCH`` (also ``$HOME``, and ``/tmp`` unless the
            Python environment itself lies under ``/tmp``).
        info_fd: a file descriptor bwrap writes ``{"child-pid": N}`` to, N being the host pid
            of the namespace's first process (killing it ends the whole sandbox).
        block_fd: bwrap waits to start ``inner`` until this file descriptor has data (or ends).
    """
    if scratch_mb <= 0:
        raise ValueError(f"scratch_mb must be positive, got {scratch_mb}")
    args = ["bwrap", "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
            "--hostname", HOSTNAME, "--die-with-parent", "--new-session"]
    if runs_as_root():
        # Real root: bwrap mounts with root's rights; the runner then drops to an unused uid
        # (it needs CAP_SETUID/CAP_SETGID for that, and nothing else).
        args += ["--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    else:
        args += ["--unshare-user", "--cap-drop", "ALL"]
        if "--disable-userns" in _bwrap_options():  # bwrap 0.8+: no nested user namespaces
            args.append("--disable-userns")
    if info_fd is not None:
        args += ["--info-fd", str(info_fd)]
    if block_fd is not None:
        args += ["--block-fd", str(block_fd)]

    mounts = environment_paths()
    clash = [m for m in mounts if _under(m, ROOT) or _under(m, "/proc") or _under(m, "/dev")]
    if clash:
        raise SandboxUnavailable(f"the Python environment lies under {clash[0]}, where the sandbox mounts its own "
                                 f"folders ({ROOT}, /proc, /dev): install the course elsewhere")
    tmp_is_scratch = not any(_under(m, "/tmp") for m in mounts)  # else /tmp holds the environment, read-only
    inside = mounts + [CELLS, *(f"{RESULTS}/{name}" for name in results), SCRATCH]
    parents = sorted({str(parent) for path in inside for parent in Path(path).parents
                      if str(parent) != "/" and not any(_under(str(parent), m) for m in mounts)},
                     key=lambda p: (p.count("/"), p))
    for link in _TOP_LEVEL:
        if os.path.islink(link):
            args += ["--symlink", os.readlink(link), link]
        elif os.path.isdir(link):
            args += ["--ro-bind", link, link]
    for parent in parents:  # readable by the dropped uid (bwrap makes missing parents 0700)
        if parent not in _TOP_LEVEL:
            args += ["--perms", "0755", "--dir", parent]
    for path in mounts:
        args += ["--ro-bind", path, path]
    for path in _ETC_FILES:
        args += ["--ro-bind-try", path, path]
    args += ["--proc", "/proc", "--dev", "/dev",
             "--perms", "01777", "--size", str(SHM_MB * 2**20), "--tmpfs", "/dev/shm",
             "--perms", "01777", "--size", str(scratch_mb * 2**20), "--tmpfs", SCRATCH,
             *(["--symlink", SCRATCH, "/tmp"] if tmp_is_scratch else []),
             "--ro-bind", str(cells), CELLS]
    for name, host in results.items():
        if "/" in name or name in ("", ".", ".."):
            raise ValueError(f"a result file name must be a plain file name, got {name!r}")
        args += ["--bind", str(host), f"{RESULTS}/{name}"]
    args += ["--remount-ro", "/", "--remount-ro", "/dev", "--chdir", SCRATCH, "--", *inner]
    return args


_FIX_INSTALL = ("install bubblewrap: `sudo apt-get install bubblewrap` (Debian, Ubuntu), "
                "`sudo dnf install bubblewrap` (Fedora), `sudo pacman -S bubblewrap` (Arch)")
_FIX_USERNS = ("allow unprivileged user namespaces, which bubblewrap needs when run by a normal user: "
               "`sudo sysctl -w kernel.unprivileged_userns_clone=1` (Debian), or on Ubuntu 23.10+ "
               "`sudo sysctl -w kernel.apparmor_restrict_unprivileged_userns=0` (or an AppArmor profile for bwrap); "
               "in a container, run it with user namespaces allowed (e.g. Docker's --security-opt seccomp=unconfined)")
_OFF = ("To grade without a sandbox anyway, pass --sandbox off: then a submission can read and change "
        "anything you can, including the other submissions and their grades.")


def _refuse(reason: str, fix: str) -> SandboxUnavailable:
    return SandboxUnavailable(
        f"attn-course grade runs every notebook in a bubblewrap sandbox, and none can be made here: {reason}.\n"
        f"Fix: {fix}.\n{_OFF}"
    )


@functools.lru_cache(maxsize=None)
def _probe(bwrap: str, root: bool) -> str | None:
    """Run a tiny Python in the same sandbox as a notebook would get; None when it worked, else bwrap's complaint."""
    with tempfile.TemporaryDirectory(prefix="attn-course-probe-") as work:
        cells, result = Path(work, "cells.json"), Path(work, "probe")
        cells.write_text("[]")
        result.touch(mode=0o600)
        uid = uid_for_slot(0) if root else os.getuid()
        code = (
            "import os, sys\n"
            f"f = open('{RESULTS}/probe', 'w')\n"
            f"if os.getuid() == 0:\n    os.setgroups([]); os.setresgid({uid}, {uid}, {uid}); os.setresuid({uid}, {uid}, {uid})\n"
            f"open('{SCRATCH}/x', 'w').write('x'); open('{CELLS}').close()\n"
            "f.write(f'ok {os.getuid()}'); f.close()"
        )
        argv = command([sys.executable, "-c", code], cells=cells, results={"probe": result}, scratch_mb=1)
        argv[0] = bwrap
        try:
            done = subprocess.run(argv, env=child_env(package_parent=work), stdin=subprocess.DEVNULL,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=60)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return f"{type(exc).__name__}: {exc}"
        if done.returncode == 0 and result.read_text() == f"ok {uid}":
            return None
        return done.stderr.decode(errors="replace").strip()[-500:] or f"bwrap exited with code {done.returncode}"


def check_available() -> None:
    """Raise ``SandboxUnavailable`` (with the fix) unless a sandbox works here; checked once per process."""
    if not sys.platform.startswith("linux"):
        raise _refuse(f"bubblewrap needs Linux (this is {sys.platform})",
                      "grade on a Linux machine or in a Linux virtual machine (on macOS, e.g. a Lima or Docker VM)")
    if not hasattr(os, "pidfd_open"):
        raise _refuse("this Python has no os.pidfd_open", "use Python 3.9 or newer on Linux 5.3 or newer")
    try:
        os.close(os.pidfd_open(os.getpid()))
    except OSError as exc:
        raise _refuse(f"the kernel has no pidfd_open ({exc.strerror})", "use Linux 5.3 or newer") from None
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        raise _refuse("the `bwrap` command is not installed", _FIX_INSTALL)
    missing = [option for option in _REQUIRED_OPTIONS if option not in _bwrap_options(bwrap)]
    if missing:
        raise _refuse(f"{bwrap} is too old: it lacks {', '.join(missing)}",
                      "install a newer bubblewrap (0.8.0, Debian 12's, has every option needed)")
    complaint = _probe(bwrap, runs_as_root())
    if complaint is not None:
        fix = _FIX_USERNS if not runs_as_root() else (
            "run attn-course grade as a normal user, or give this root the rights to mount (CAP_SYS_ADMIN)")
        raise _refuse(f"bwrap could not start a sandbox ({complaint})", fix)
