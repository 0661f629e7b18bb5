"""Probes: what the learner's function *did* while it ran, not only what it returned.

A task that is about an algorithm's form or cost declares what to watch (``Task.measure``,
``Task.forbidden``); ``run_cases`` then calls the learner's function inside a :class:`Probe`,
and each ``Outcome`` carries the measurements in ``outcome.probe``, a small dict of plain
values. The same code runs in the notebook's ``check()`` and in the batch grader's child
process, and the dict survives ``Outcome.to_plain``/``from_plain``, so the parent judges it
exactly like an in-process ``check()`` would.

What is measured (keys of ``outcome.probe``)
--------------------------------------------
``largest_numel``, ``largest_shape``, ``largest_op`` (``measure=("largest",)``)
    The largest tensor created during the call, in elements, with its shape (``"512 x 384"``)
    and the aten op that made it. A :class:`~torch.utils._python_dispatch.TorchDispatchMode`
    sees every aten op's outputs, forward and backward, factories (``zeros``, ``ones``,
    ``arange``) and masks included. The case's inputs are not counted (they exist before the
    call). **Views and in-place results are not counted**: an output that shares its storage
    with one of the op's inputs (``view``, ``expand``, ``transpose``, ``x.add_(1)``, ...)
    allocates nothing new, so ``mask.expand(L, S)`` is free while ``mask.expand(L, S).clone()``
    or ``torch.zeros(L, S)`` counts ``L * S``. Elements, not bytes: a bool ``(L, S)`` mask is as
    quadratic as a float one.
``widest_reduction``, ``widest_shape``, ``widest_op`` (``measure=("widest",)``)
    The longest axis one op combined at once, with the shape it read and the op: the contraction
    axis of a matrix product (``mm``, ``bmm``, ``addmm``, ``baddbmm``, ``dot``, ``mv``; ``matmul``
    and ``einsum`` reach these), the axis of a softmax or log-softmax, and the axes of a
    ``sum``/``mean``/``amax``/``amin``/``max``/``min``/``logsumexp``/``prod``/``var``/``std``
    along given dims (their product when several). Floating-point inputs only (``mask.any(-1)``
    is bookkeeping, not a softmax); a reduction of a whole tensor (no dim) is not counted. It is
    measured per computation, not per batch: the softmax of one (batch, head) slice's ``(L, S)``
    scores reduces over ``S`` exactly as the batched one does, so an algorithm that must never
    look at all ``S`` keys of a row at once (the online softmax) is caught however it loops.
``flops`` (``measure=("flops",)``)
    Work done during the call, counted in the same dispatch mode: matrix products and
    convolutions exactly as :class:`torch.utils.flop_counter.FlopCounterMode` counts them
    (2 per multiply-add), plus, for every other op that is not a view, one per element of the
    largest tensor it reads or writes (``exp``, ``cumsum``, ``sum``, copies, ...). FlopCounterMode
    alone counts 0 for an algorithm made of ``cumsum`` and products, which is exactly the form
    linear attention's prefix sums take; this count sees it. It is an estimate for comparing
    algorithms ("within a factor of the intended one"), not a hardware figure.
``op_count``, ``op_names`` (``measure=("ops",)``)
    How many aten ops ran during the call (views included) and the sorted names of the distinct
    ops (``["aten.constant_pad_nd", "aten.slice", "aten.view"]``). For telling algorithms of one
    result apart by their form: an index tensor shows as ``aten.gather`` or ``aten.index``, and a
    Python loop over positions as an op count that grows with the length.
``forbidden_calls`` (``forbidden=(...)``)
    The declared names of the forbidden implementations the call reached (for an aten
    pattern, the op's own name), in the order first met (a list of str, empty when none).
    Two mechanisms, both active only during the call:

    * ``sys.setprofile`` (restored afterwards) sees every Python function call and every call
      of a builtin. A Python function is matched by its *code object*, so every route reaches
      it: ``ac.causal_mask``, ``from attn_course.masks import causal_mask``, an alias, a
      library helper that calls it. A builtin (``torch.nn.functional.scaled_dot_product_attention``)
      is matched by identity, a ``torch.Tensor`` method (``torch.Tensor.repeat_interleave``) by its
      name when called on a tensor (``x.repeat_interleave(...)``). A class name means its
      ``forward`` (``torch.nn.MultiheadAttention``).
    * The dispatch mode matches aten op names against patterns (``"aten._scaled_dot_product_*"``),
      so PyTorch's fused attention kernels are caught however they were reached
      (``torch.ops.aten...``, a module's fast path). An exact aten name (no ``*``) is also
      caught at its Python entry point ``torch.ops.aten.<name>``, which matters for composite
      ops that decompose (math backend) before any dispatch mode sees them.

    Everything that runs during the call counts, at any depth: a library helper that calls a
    forbidden function is a call to it. So forbid the task's own concept, never a building block
    the learner may use.
``probe_error`` (only when something went wrong)
    What could not be measured, and why (the learner's code replaced the profile hook, a
    C-level profiler such as cProfile was running so no hook could be installed, a FLOP
    formula failed). A check that needs a missing measurement fails and says so.

A fused kernel is one op: its internal buffers are invisible to ``largest`` and FlopCounterMode
has no formula for the CPU flash kernel, which is one more reason to forbid it where the task is
attention itself. Cost: some tens of microseconds per aten op (the profile hook is paused inside
the dispatch mode's own code), nothing when a task declares no probes.

Limits, said plainly: this is in-process detection. It stops the honest shortcut (calling the
library, or the quadratic form a learner writes without thinking), not a determined cheat: code
that runs in the same process can copy the library's source, compute in NumPy, or switch the
profile hook off. The batch grader's guarantees (its parent never runs submission code) are
about not letting a submission forge its grade, and stay as they were.

Hints the judges give are built by the helpers in :mod:`attn_course.grading.judging`
(``expect_largest_below``, ``expect_flops_at_most``) and the delegation rule in
:mod:`attn_course.grading.core` (a forbidden call gives the whole task zero). Taught in lesson
00 (how exercises and grading work).
"""

from __future__ import annotations

import fnmatch
import importlib
import importlib.util
import inspect
import sys
from collections.abc import Callable, Iterable, Sequence
from functools import lru_cache
from types import CodeType
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = [
    "MEASURES",
    "FUSED_ATTENTION",
    "TORCH_ATTENTION",
    "TORCH_MULTIHEAD",
    "Probe",
    "probe_call",
    "resolve_forbidden",
    "display_name",
    "delegation_message",
]

MEASURES = ("largest", "flops", "widest", "ops")

# PyTorch's fused attention kernels at the aten level: whatever Python route reached them.
FUSED_ATTENTION = (
    "aten.scaled_dot_product_attention",
    "aten._scaled_dot_product_*",
    "aten._flash_attention_*",
    "aten._efficient_attention_*",
    "aten._fused_sdp_choice",
    "aten._native_multi_head_attention",
)
# Ready-made groups for ``Task.forbidden``.
TORCH_ATTENTION = ("torch.nn.functional.scaled_dot_product_attention", *FUSED_ATTENTION)
TORCH_MULTIHEAD = (
    "torch.nn.MultiheadAttention",
    "torch.nn.functional.multi_head_attention_forward",
    "aten._native_multi_head_attention",
)

# Bound at import, before any submission code runs in the batch grader's child.
_setprofile = sys.setprofile
_getprofile = sys.getprofile

try:  # FlopCounterMode's formulas for matrix products, convolutions and fused attention
    from torch.utils.flop_counter import flop_registry as _FLOP_FORMULAS
except ImportError:  # pragma: no cover - very old PyTorch
    _FLOP_FORMULAS = {}


# --- forbidden names -----------------------------------------------------------------------


class _Resolved:
    """Forbidden names turned into what the hooks compare against."""

    def __init__(self) -> None:
        self.codes: dict[CodeType, str] = {}  # Python functions, by code object
        self.builtins: dict[int, tuple[Any, str]] = {}  # builtins, by id (object kept alive)
        self.tensor_methods: dict[str, str] = {}  # torch.Tensor methods, by name: x.method(...) is a bound builtin
        self.aten_patterns: list[tuple[str, str]] = []  # (fnmatch pattern, declared name)
        # Names in modules nobody has imported yet, by the module's file: resolved when code from that file
        # first runs (importing them up front can cost seconds: torch.nn.attention.bias loads torch._dynamo).
        self.pending: dict[str, list[str]] = {}

    def resolve_pending(self, filename: str) -> None:
        """Resolve the names waiting for ``filename``'s module, now that its code runs; keep those not defined yet."""
        waiting = []
        for name in self.pending.pop(filename, []):
            try:
                _add_forbidden(self, name, _import_dotted(name))
            except (ImportError, AttributeError):  # the module is still executing its top level
                waiting.append(name)
        if waiting:
            self.pending[filename] = waiting


def _import_dotted(name: str) -> Any:
    """``"a.b.c.d"`` -> the object, importing the longest module prefix that exists."""
    parts = name.split(".")
    for split in range(len(parts), 0, -1):
        module_name = ".".join(parts[:split])
        try:
            obj = importlib.import_module(module_name)
        except ImportError:
            continue
        for attribute in parts[split:]:
            obj = getattr(obj, attribute)
        return obj
    raise ImportError(f"no module in {name!r} can be imported")


def _code_of(obj: Any) -> CodeType | None:
    obj = inspect.unwrap(obj) if callable(obj) else obj
    if isinstance(obj, (staticmethod, classmethod)):
        obj = obj.__func__
    if inspect.ismethod(obj):
        obj = obj.__func__
    return getattr(obj, "__code__", None)


def _aten_entry_points(op_name: str) -> list:
    """The builtins that ``torch.ops.aten.<op_name>(...)`` and its overloads call.

    Composite ops such as ``aten.scaled_dot_product_attention`` may decompose (math backend)
    before a dispatch mode sees them; the profile hook still sees their Python entry point.
    """
    packet = getattr(torch.ops.aten, op_name, None)
    if packet is None:
        return []
    found = [getattr(packet, "_op", None)]
    for overload in packet.overloads():
        found.append(getattr(getattr(packet, overload), "_op", None))
    return [b for b in found if b is not None and not hasattr(b, "__code__")]


@lru_cache(maxsize=None)
def resolve_forbidden(names: tuple[str, ...]) -> _Resolved:
    """Resolve ``Task.forbidden`` names once; raise ``ValueError`` naming one that does not exist.

    A name is a dotted path to a Python function or method, a builtin, or a class (meaning its
    ``forward``, or ``__call__`` when it has none), or an aten pattern ``"aten.<op name>"`` with
    ``*`` wildcards.
    """
    resolved = _Resolved()
    for name in names:
        if name.startswith("aten."):
            resolved.aten_patterns.append((name, name))
            if "*" not in name:  # also its Python entry point, for ops that decompose before dispatch
                for builtin in _aten_entry_points(name[len("aten."):]):
                    resolved.builtins[id(builtin)] = (builtin, name)
            continue
        unloaded = _unloaded_module_file(name)
        if unloaded is not None:  # a call into it must first import it: wait for its code to run
            resolved.pending.setdefault(unloaded, []).append(name)
            continue
        try:
            obj = _import_dotted(name)
        except (ImportError, AttributeError) as exc:
            raise ValueError(f"forbidden name {name!r} does not resolve ({type(exc).__name__}: {exc})") from None
        _add_forbidden(resolved, name, obj)
    return resolved


def _add_forbidden(resolved: _Resolved, name: str, obj: Any) -> None:
    """Record ``obj`` (what ``name`` names) where the hooks look for it."""
    if inspect.isclass(obj):
        obj = getattr(obj, "forward", None) or obj.__call__
    code = _code_of(obj)
    if code is not None:
        resolved.codes[code] = name
    elif inspect.ismethoddescriptor(obj) and issubclass(torch.Tensor, getattr(obj, "__objclass__", type(None))):
        resolved.tensor_methods[obj.__name__] = name  # "torch.Tensor.repeat_interleave": x.repeat_interleave(...)
    elif callable(obj):  # a builtin: matched by identity in c_call events
        resolved.builtins[id(obj)] = (obj, name)
    else:
        raise ValueError(f"forbidden name {name!r} is a {type(obj).__name__}, not something one can call")


def _unloaded_module_file(name: str) -> str | None:
    """The source file of the first module on ``name``'s dotted path that is not imported yet, or None.

    Only when its parent package is imported (finding a module's file then imports nothing) and the
    module is plain Python; None means "import and resolve now".
    """
    parts = name.split(".")
    for split in range(1, len(parts) + 1):
        module = ".".join(parts[:split])
        if module in sys.modules:
            continue
        parent = ".".join(parts[: split - 1])
        if parent and parent not in sys.modules:
            return None
        try:
            spec = importlib.util.find_spec(module)
        except (ImportError, ValueError):
            return None
        if spec is None or not spec.origin or not spec.origin.endswith(".py"):
            return None  # an attribute of an imported module, or not plain Python
        return spec.origin
    return None


def display_name(name: str) -> str:
    """How a hint names a forbidden implementation: ``attn_course.causal_mask`` where the package exports it."""
    if name.startswith("attn_course.") and name.count(".") >= 2:
        short = name.rsplit(".", 1)[1]
        try:
            package = importlib.import_module("attn_course")
            if getattr(package, short, None) is _import_dotted(name):
                return f"attn_course.{short}"
        except (ImportError, AttributeError):
            pass
    if name.startswith("aten."):
        return f"PyTorch's {name}"
    return name


def delegation_message(calls: Sequence[str]) -> str:
    """The feedback for a forbidden call: it names what was called (Python-level names first)."""
    python_level = [c for c in calls if not c.startswith("aten.")]
    named = [display_name(c) for c in (python_level or calls)[:2]]
    return (
        f"you called {' and '.join(named)}: write it yourself, then use the library to check it. "
        "This exercise asks for the implementation, so a call into one gives the task zero."
    )


# --- the dispatch mode ---------------------------------------------------------------------


def _tensors(values: Iterable) -> list[torch.Tensor]:
    """The tensors among aten arguments or results: tensors, and lists/tuples of them (cat, split)."""
    found = []
    for value in values:
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, (list, tuple)):
            found.extend(v for v in value if isinstance(v, torch.Tensor))
    return found


def _storage_key(t: torch.Tensor) -> int | None:
    try:
        return t.untyped_storage().data_ptr()
    except Exception:  # sparse, meta or exotic tensors have no plain storage
        return None


# What measuring an odd op may raise. Not `Exception`: the per-call timeout is an Exception raised
# by a signal handler wherever the code happens to be, and swallowing it here would loop forever.
_MEASURING_ERRORS = (RuntimeError, TypeError, ValueError, AttributeError, IndexError, KeyError, AssertionError)


# Matrix products: which argument holds the contraction axis as its last dim.
_PRODUCTS = {"aten.mm": 0, "aten.bmm": 0, "aten.mv": 0, "aten.dot": 0, "aten.vdot": 0,
             "aten.addmm": 1, "aten.baddbmm": 1, "aten.addbmm": 1, "aten.addmv": 1}
_SOFTMAXES = {"aten._softmax", "aten._log_softmax", "aten._safe_softmax", "aten.softmax", "aten.log_softmax"}
_REDUCTIONS = {"aten.sum", "aten.mean", "aten.amax", "aten.amin", "aten.logsumexp", "aten.prod", "aten.nansum",
               "aten.var", "aten.std", "aten.var_mean", "aten.std_mean", "aten.max", "aten.min", "aten.norm",
               "aten.linalg_vector_norm"}


def _reduced_extent(func, args, kwargs) -> tuple[int, torch.Tensor | None]:
    """``(extent, tensor read)``: how many entries this op combined at once along its reduced axes (0: none)."""
    name = str(func._overloadpacket)
    if name in _PRODUCTS:
        source = args[_PRODUCTS[name]] if len(args) > _PRODUCTS[name] else None
        if isinstance(source, torch.Tensor) and source.dim() >= 1 and source.is_floating_point():
            return int(source.shape[-1]), source
        return 0, None
    if name not in _SOFTMAXES and name not in _REDUCTIONS:
        return 0, None
    source = args[0] if args else None
    if not isinstance(source, torch.Tensor) or not source.is_floating_point() or source.dim() == 0:
        return 0, None
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    if name == "aten.linalg_vector_norm":
        dim = args[2] if len(args) > 2 else kwargs.get("dim")
    if isinstance(dim, bool) or dim is None:
        return 0, None
    dims = [dim] if isinstance(dim, int) else list(dim) if isinstance(dim, (list, tuple)) else []
    if not dims or not all(isinstance(d, int) and not isinstance(d, bool) for d in dims):
        return 0, None  # a whole-tensor reduction, or something odd
    extent = 1
    for d in dims:
        extent *= int(source.shape[d])
    return extent, source


class _Recorder(TorchDispatchMode):
    """Sees every aten op while the learner's function runs."""

    def __init__(self, probe: Probe) -> None:
        super().__init__()
        self.probe = probe

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # PyTorch otherwise wraps __torch_dispatch__ in torch._disable_dynamo, whose first call imports
        # torch._dynamo (and sympy): about 800 modules, 1.5 s idle and 20 s on a loaded machine, inside the
        # learner's first timed call. Nothing here is compiled, so there is nothing for Dynamo to skip.
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        # No Python function of interest runs inside an aten op: pause the profile hook, which would
        # otherwise fire on every Python call made here and triple the cost of each op.
        hook = self.probe._hook if _getprofile() is self.probe._hook else None
        if hook is not None:
            _setprofile(None)
        try:
            out = func(*args, **kwargs)
            try:
                self.probe._on_op(func, args, kwargs, out)
            except _MEASURING_ERRORS as exc:  # a probe must never change what the learner's code computes
                self.probe.errors.append(f"{func}: {type(exc).__name__}: {exc}")
            # Anything else (the grader's timeout, raised by a signal while this ran) goes on up.
        finally:
            if hook is not None:
                _setprofile(hook)
        return out


class Probe:
    """Context manager: measure and watch everything that runs inside it.

    ``with Probe(measure=("largest", "flops"), forbidden=("attn_course.masks.causal_mask",)) as p:
    fn(...)``; then ``p.result()`` is the dict that goes into ``Outcome.probe``.
    """

    def __init__(self, *, measure: Sequence[str] = (), forbidden: Sequence[str] = ()) -> None:
        unknown = sorted(set(measure) - set(MEASURES))
        if unknown:
            raise ValueError(f"unknown measure {unknown}; known: {list(MEASURES)}")
        self.measure = tuple(measure)
        self.forbidden = tuple(forbidden)
        self._targets = resolve_forbidden(self.forbidden) if self.forbidden else None
        self.largest_numel = 0
        self.largest_shape = ""
        self.largest_op = ""
        self.flops = 0
        self.widest = 0
        self.widest_shape = ""
        self.widest_op = ""
        self.op_count = 0
        self.op_names: set[str] = set()
        self.calls: list[str] = []
        self.errors: list[str] = []
        self._mode: _Recorder | None = None
        self._previous_profile: Callable | None = None
        self._hook = self._profile  # one bound method, so that `is` can tell whether it is still installed
        self._profiling = False

    @property
    def active(self) -> bool:
        return bool(self.measure or self.forbidden)

    # -- hooks --

    def _record_call(self, name: str) -> None:
        if name not in self.calls:
            self.calls.append(name)

    def _profile(self, frame, event, arg) -> None:
        targets = self._targets
        if event == "call":
            code = frame.f_code
            if targets.pending and code.co_filename in targets.pending:
                targets.resolve_pending(code.co_filename)
            name = targets.codes.get(code)
            if name is not None:
                self._record_call(name)
        elif event == "c_call":
            hit = targets.builtins.get(id(arg))
            if hit is not None and hit[0] is arg:
                self._record_call(hit[1])
            elif targets.tensor_methods and isinstance(getattr(arg, "__self__", None), torch.Tensor):
                name = targets.tensor_methods.get(getattr(arg, "__name__", ""))
                if name is not None:
                    self._record_call(name)

    def _on_op(self, func, args, kwargs, out) -> None:
        if self._targets is not None and self._targets.aten_patterns:
            op_name = str(func._overloadpacket)  # e.g. "aten._scaled_dot_product_flash_attention_for_cpu"
            for pattern, name in self._targets.aten_patterns:
                if fnmatch.fnmatchcase(op_name, pattern):
                    self._record_call(op_name)  # the op itself, which says more than the pattern
        if not self.measure:
            return
        if "ops" in self.measure:
            self.op_count += 1
            self.op_names.add(str(func._overloadpacket))
        inputs = _tensors(args) + _tensors(kwargs.values())
        outputs = _tensors((out,))
        if "largest" in self.measure:
            input_storages = {_storage_key(t) for t in inputs}
            for t in outputs:
                if t.numel() > self.largest_numel and _storage_key(t) not in input_storages:
                    self.largest_numel = t.numel()
                    self.largest_shape = " x ".join(str(n) for n in t.shape) or "scalar"
                    self.largest_op = str(func._overloadpacket)
        if "widest" in self.measure:
            width, read = _reduced_extent(func, args, kwargs)
            if width > self.widest:
                self.widest = width
                self.widest_shape = " x ".join(str(n) for n in read.shape) or "scalar"
                self.widest_op = str(func._overloadpacket)
        if "flops" in self.measure:
            formula = _FLOP_FORMULAS.get(func._overloadpacket)
            if formula is not None:
                self.flops += int(formula(*args, **kwargs, out_val=out))
            elif not func.is_view:
                self.flops += max((t.numel() for t in inputs + outputs), default=0)

    # -- context manager --

    def __enter__(self) -> Probe:
        if self.forbidden:
            previous = _getprofile()
            if previous is None or callable(previous):
                self._previous_profile = previous
                _setprofile(self._hook)
                self._profiling = True
            else:  # a C-level profiler (cProfile) is running; it cannot be put back once replaced
                self.errors.append("a profiler was running, so calls to forbidden functions were not watched")
        if self.measure or (self._targets is not None and self._targets.aten_patterns):
            self._mode = _Recorder(self)
            self._mode.__enter__()
        return self

    def __exit__(self, *exc_info) -> None:
        if self._profiling:
            if _getprofile() is not self._hook:
                self.errors.append("the profile hook was replaced during the call; forbidden calls may be missed")
            _setprofile(self._previous_profile)
            self._profiling = False
        if self._mode is not None:
            mode, self._mode = self._mode, None
            mode.__exit__(*exc_info)

    def result(self) -> dict:
        """The measurements, as plain values (what ``Outcome.probe`` holds)."""
        found: dict = {}
        if "largest" in self.measure:
            found.update(largest_numel=self.largest_numel, largest_shape=self.largest_shape, largest_op=self.largest_op)
        if "flops" in self.measure:
            found["flops"] = self.flops
        if "widest" in self.measure:
            found.update(widest_reduction=self.widest, widest_shape=self.widest_shape, widest_op=self.widest_op)
        if "ops" in self.measure:
            found.update(op_count=self.op_count, op_names=sorted(self.op_names))
        if self.forbidden:
            found["forbidden_calls"] = list(self.calls)
        if self.errors:
            found["probe_error"] = "; ".join(self.errors)[:500]
        return found


def probe_call(fn: Callable, *args, measure: Iterable[str] = MEASURES, forbidden: Iterable[str] = (), **kwargs) -> dict:
    """``fn(*args, **kwargs)`` under a :class:`Probe`; returns the probe dict (handy in lessons and tests)."""
    probe = Probe(measure=tuple(measure), forbidden=tuple(forbidden))
    with probe:
        fn(*args, **kwargs)
    return probe.result()
