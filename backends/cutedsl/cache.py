"""Compile cache of the CuTe DSL kernels: in memory and on disk, with compile-time records.

A kernel is compiled once per (:class:`kda.backends.cutedsl.problem.Problem`,
:class:`kda.backends.cutedsl.schedule.Schedule`, target architecture, source hash).
The compiled host launcher + cubin is exported as an object file
(``JitCompiledFunction.export_to_c``) into the cache directory (``$KDA_CACHE_DIR/cutedsl``,
default ``~/.cache/kda/cutedsl``) and loaded back with ``cutlass.runtime.load_module`` by
later processes, so a warm process start does not trace or compile. Every compile (or load)
is recorded in :data:`COMPILE_LOG` and logged; :func:`compile_seconds` sums them for the
benchmark.

Compilation needs no GPU: with ``CUTE_DSL_ARCH=sm_90a`` (set before CuTe DSL is imported)
:func:`compile_kernel` traces and compiles against fake pointers, which is what the CPU test
``tests/backends/cutedsl/test_compile.py`` does for every configuration axis.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import tempfile
import threading
import time
from typing import Dict, List, Optional, Tuple

from kda.backends.cutedsl.problem import Problem
from kda.backends.cutedsl.schedule import Rows, Schedule
from kda.backends.cutedsl.static import default_cache_dir

log = logging.getLogger("kda")

_HERE = os.path.dirname(os.path.abspath(__file__))


def _sources() -> List[str]:
    """Every Python source of this package, in name order (a new file is part of the key)."""
    return sorted(n for n in os.listdir(_HERE) if n.endswith(".py"))


@dataclasses.dataclass
class CompileRecord:
    """One kernel made available: compiled (``source="compile"``) or loaded from disk;
    ``name``: its schedule's :attr:`Schedule.name`."""

    name: str
    tag: str
    arch: str
    source: str
    seconds: float


#: Every compile / disk load of this process, in order.
COMPILE_LOG: List[CompileRecord] = []
_mem: Dict[Tuple[Problem, Schedule, str], object] = {}
_lock = threading.Lock()
_src_hash: Optional[str] = None


def source_hash() -> str:
    """Hash of this package's sources (every ``*.py`` file, names and contents) and the CuTe
    DSL version (part of every key)."""
    global _src_hash
    if _src_hash is None:
        h = hashlib.sha256()
        for name in _sources():
            h.update(name.encode() + b"\0")
            with open(os.path.join(_HERE, name), "rb") as f:
                h.update(f.read())
        try:
            from importlib.metadata import version
            h.update(version("nvidia-cutlass-dsl").encode())
        except Exception:  # noqa: BLE001 - version is best effort
            pass
        _src_hash = h.hexdigest()[:12]
    return _src_hash


def target_arch() -> str:
    """The architecture CuTe DSL compiles for in this process (e.g. "sm_90a")."""
    from cutlass.base_dsl.env_manager import EnvironmentVarManager  # noqa: F401
    from cutlass.cutlass_dsl import CuTeDSL
    return str(CuTeDSL._get_dsl().envar.arch)


def kernel_object(pb: Problem, sched: Schedule):
    """The kernel object serving ``pb`` with ``sched``, by how the schedule cuts an item's
    rows: :class:`KdaWide` (``Rows.CTA``), :class:`KdaSplit` (``Rows.CLUSTER``) or
    :class:`KdaStream` (``Rows.WARP``).

    Raises:
      ValueError: a schedule that cannot serve ``pb`` (:meth:`Schedule.check`).
    """
    sched.check(pb)
    if sched.rows == Rows.CTA:
        from kda.backends.cutedsl.wide import KdaWide
        return KdaWide(pb, sched)
    if sched.rows == Rows.CLUSTER:
        from kda.backends.cutedsl.split import KdaSplit
        return KdaSplit(pb, sched)
    from kda.backends.cutedsl.stream import KdaStream
    return KdaStream(pb, sched)


def compile_kernel(pb: Problem, sched: Schedule, options: Optional[str] = None):
    """Trace and compile the kernel of ``pb`` and ``sched`` (no GPU needed). Returns
    (compiled, seconds)."""
    import cutlass.cute as cute

    from kda.backends.cutedsl.args import compile_args
    obj = kernel_object(pb, sched)
    t0 = time.perf_counter()
    if options:
        compiled = cute.compile(obj.launch, *compile_args(pb), options=options)
    else:
        compiled = cute.compile(obj.launch, *compile_args(pb))
    return compiled, time.perf_counter() - t0


def _prefix(pb: Problem, sched: Schedule, arch: str) -> str:
    tag = f"kda_{sched.tag()}_{pb.tag()}_{arch}_{source_hash()}"
    return "".join(c if c.isalnum() else "_" for c in tag)


def get_kernel(pb: Problem, sched: Schedule, use_disk: bool = True):
    """The compiled kernel (a CuTe DSL ``JitCompiledFunction``), from memory, disk or compiled.

    Raises:
      Any CuTe DSL compilation error (a bug: every supported configuration compiles).
    """
    arch = target_arch()
    key = (pb, sched, arch)
    with _lock:
        fn = _mem.get(key)
        if fn is not None:
            return fn
        prefix = _prefix(pb, sched, arch)
        cache_dir = default_cache_dir()
        path = os.path.join(cache_dir, prefix + ".o")
        fn = None
        if use_disk and os.path.exists(path):
            t0 = time.perf_counter()
            try:
                import cutlass.cute as cute  # noqa: F401 - registers the load provider
                import cutlass.cute.export  # noqa: F401
                from cutlass.runtime import load_module
                fn = load_module(path)[prefix]
                _record(pb, sched, arch, "disk", time.perf_counter() - t0)
            except Exception as e:  # noqa: BLE001 - a stale or broken file: recompile
                log.warning("cutedsl: cannot load %s (%s: %s); recompiling", path,
                            type(e).__name__, e)
                fn = None
        if fn is None:
            fn, secs = compile_kernel(pb, sched)
            _record(pb, sched, arch, "compile", secs)
            if use_disk:
                _export(fn, cache_dir, prefix)
        _mem[key] = fn
        return fn


def _export(fn, cache_dir: str, prefix: str) -> None:
    """Write the object file atomically; failures only cost the next process a compile."""
    try:
        import cutlass.cute.export  # noqa: F401 - registers the export provider
        os.makedirs(cache_dir, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cache_dir) as tmp:
            fn.export_to_c(tmp, "k", function_prefix=prefix)
            os.replace(os.path.join(tmp, "k.o"), os.path.join(cache_dir, prefix + ".o"))
    except Exception as e:  # noqa: BLE001
        log.warning("cutedsl: cannot write the compile cache in %s (%s: %s)", cache_dir,
                    type(e).__name__, e)


def _record(pb: Problem, sched: Schedule, arch: str, source: str, seconds: float) -> None:
    rec = CompileRecord(sched.name, f"{sched.tag()}_{pb.tag()}", arch, source, seconds)
    COMPILE_LOG.append(rec)
    log.info("cutedsl: %s kernel %s for %s: %s in %.2f s", rec.name, rec.tag, arch,
             "compiled" if source == "compile" else "loaded from disk", seconds)


def compile_seconds(name: Optional[str] = None) -> float:
    """Total seconds spent compiling / loading kernels in this process (optionally those of
    one schedule name)."""
    return sum(r.seconds for r in COMPILE_LOG if name is None or r.name == name)


def _compile_one(pb: Problem, sched: Schedule) -> Tuple[str, float]:
    """A worker of :func:`precompile`: the kernel into the disk cache."""
    from kda.backends.cutedsl.backend import import_cutedsl
    why = import_cutedsl()
    if why is not None:
        raise RuntimeError(why)
    t0 = time.perf_counter()
    get_kernel(pb, sched)
    return f"{sched.name} {pb.tag()}", time.perf_counter() - t0


def precompile(builds, jobs: Optional[int] = None) -> List[Tuple[str, float]]:
    """Compile the (problem, schedule) pairs ``builds`` into the disk cache in ``jobs``
    processes at once (default: one per CPU), so that a later process loads them instead of
    compiling one after the other (a tuning run compiles some 200). Returns (build, seconds)
    per pair, in order.

    Raises:
      Whatever a compile raises (a bug: every pair a schedule accepts compiles).
    """
    import concurrent.futures
    import multiprocessing

    builds = list(dict.fromkeys(builds))
    jobs = max(1, min(jobs or os.cpu_count() or 1, len(builds)))
    if jobs == 1:
        return [_compile_one(pb, s) for pb, s in builds]
    ctx = multiprocessing.get_context("spawn")      # no forked CUDA or MLIR state
    with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=ctx) as pool:
        return list(pool.map(_compile_one, *zip(*builds)))
