"""Compile cache of the CuTe DSL kernels: in memory and on disk, with compile-time records.

A kernel is compiled once per (kind, :class:`KernelStatic`, target architecture, source hash).
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

from kda.backends.cutedsl import policy
from kda.backends.cutedsl.static import KernelStatic, default_cache_dir
from kda.config import KdaArgs

log = logging.getLogger("kda")

_HERE = os.path.dirname(os.path.abspath(__file__))


def _sources() -> List[str]:
    """Every Python source of this package, in name order (a new file is part of the key)."""
    return sorted(n for n in os.listdir(_HERE) if n.endswith(".py"))

#: Pointer arguments, in kernel order, which is :class:`kda.config.KdaArgs`' field order (the
#: launcher passes the record's tensors as they come): (name, dtype key, assumed alignment in
#: bytes). "rows": the row tensors' alignment, :attr:`KernelStatic.row_bytes`; "beta": fp32
#: (4 bytes) with :attr:`KernelStatic.beta_activated`, else bf16 (2).
POINTER_ARGS = (
    ("x", "bf16", "rows"), ("cw", "cw", 4), ("cb", "f32", 4), ("cs", "cs", 16),
    ("fa", "bf16", "rows"), ("fb", "bf16", 4), ("beta", "beta", "beta"), ("alog", "f32", 4),
    ("dtb", "f32", 4), ("state", "st", 16), ("si", "i32", 4), ("og", "bf16", "rows"),
    ("nw", "nw", 4), ("na", "i32", 4), ("vrec", "f32", 4), ("kgrec", "bf16", 2),
    ("out", "bf16", "rows"),
)
assert len(POINTER_ARGS) == len(KdaArgs._fields)
#: Scalar arguments after the pointers: (name, kind) with kind i32 / i64 / f32. ``ctas`` is the
#: persistent grid of the streamed kernel (the others size their grids from R).
SCALAR_ARGS = (
    ("R", "i32"), ("slots", "i32"), ("x_rs", "i32"), ("fa_rs", "i32"), ("beta_rs", "i32"),
    ("og_rs", "i32"), ("out_rs", "i32"), ("state_ss", "i64"), ("cs_ss", "i64"),
    ("scale", "f32"), ("eps", "f32"), ("lb", "f32"), ("ctas", "i32"),
)


def arg_names(kind: str) -> List[str]:
    """Runtime argument names of a kernel (every kind takes the same) in order, the CUDA
    stream last."""
    return [n for n, _, _ in POINTER_ARGS] + [n for n, _ in SCALAR_ARGS] + ["stream"]


@dataclasses.dataclass
class CompileRecord:
    """One kernel made available: compiled (``source="compile"``) or loaded from disk."""

    kind: str
    tag: str
    arch: str
    source: str
    seconds: float


#: Every compile / disk load of this process, in order.
COMPILE_LOG: List[CompileRecord] = []
_mem: Dict[Tuple[str, KernelStatic, str], object] = {}
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


def _dtype(key: str, ks: KernelStatic):
    from cutlass import BFloat16, Float32, Int32
    if key == "cw":
        key = "bf16" if ks.cw_bf16 else "f32"
    elif key == "cs":
        key = "bf16" if ks.cs_bf16 else "f32"
    elif key == "nw":
        key = "bf16" if ks.nw_bf16 else "f32"
    elif key == "beta":
        key = "f32" if ks.beta_activated else "bf16"
    elif key == "st":
        key = "bf16" if ks.state_bf16 else "f32"
    return {"bf16": BFloat16, "f32": Float32, "i32": Int32}[key]


def assumed_align(align, ks: KernelStatic) -> int:
    """A :data:`POINTER_ARGS` alignment for ``ks``, in bytes."""
    if align == "rows":
        return ks.row_bytes
    if align == "beta":
        return 4 if ks.beta_activated else 2
    return align


def compile_args(kind: str, ks: KernelStatic) -> list:
    """Fake arguments for ``cute.compile``: null pointers with the alignments the kernel assumes
    (the row tensors' from ``ks.row_bytes``: a launch passes them only on rows that have it)."""
    import cuda.bindings.driver as cuda
    import cutlass.cute as cute
    from cutlass import Float32, Int32, Int64
    from cutlass.cute.runtime import make_ptr

    args = []
    for _, key, align in POINTER_ARGS:
        dt = _dtype(key, ks)
        args.append(make_ptr(dt, 0, cute.AddressSpace.gmem,
                             assumed_align=min(assumed_align(align, ks), 16)))
    scalars = SCALAR_ARGS
    for _, k in scalars:
        args.append({"i32": Int32(1), "i64": Int64(1), "f32": Float32(1.0)}[k])
    args.append(cuda.CUstream(0))
    return args


def kernel_object(kind: str, ks: KernelStatic):
    """The kernel object of ``kind``: "wide" (:class:`KdaWide`), "splitC" (:class:`KdaSplit`
    on clusters of C CTAs), "stream" (:class:`KdaStream`, persistent), "streamg" (persistent, the
    consumer groups preparing their own items; T = 1) or "streamC" (:class:`KdaStream` on CTAs
    of C items in blocks of C requests, C in 2, 4, 8, 16).

    Raises:
      ValueError: an unknown kind (or "streamg" at T > 1).
    """
    if kind == "wide":
        from kda.backends.cutedsl.wide import KdaWide
        return KdaWide(ks)
    if kind == "stream":
        from kda.backends.cutedsl.stream import KdaStream
        return KdaStream(ks)
    if kind == "streamg":
        from kda.backends.cutedsl.stream import KdaStream
        return KdaStream(ks, group_prep=True)
    block = policy.block_of(kind)
    if block in policy.STREAM_BLOCKS and kind == f"stream{block}":
        from kda.backends.cutedsl.stream import KdaStream
        return KdaStream(ks, block=block)
    if kind.startswith("split") and kind[5:].isdigit():
        from kda.backends.cutedsl.split import KdaSplit
        return KdaSplit(ks, int(kind[5:]))
    raise ValueError(f"kind: expected 'wide', 'stream', 'streamg', 'streamC' (C in 2, 4, 8, 16) or 'splitC' "
                     f"(C in 2, 4, 8), got {kind!r}")


def compile_kernel(kind: str, ks: KernelStatic, options: Optional[str] = None):
    """Trace and compile ``kind`` for ``ks`` (no GPU needed). Returns (compiled, seconds)."""
    import cutlass.cute as cute
    obj = kernel_object(kind, ks)
    t0 = time.perf_counter()
    if options:
        compiled = cute.compile(obj.launch, *compile_args(kind, ks), options=options)
    else:
        compiled = cute.compile(obj.launch, *compile_args(kind, ks))
    return compiled, time.perf_counter() - t0


def _prefix(kind: str, ks: KernelStatic, arch: str) -> str:
    tag = f"kda_{kind}_{ks.tag()}_{arch}_{source_hash()}"
    return "".join(c if c.isalnum() else "_" for c in tag)


def get_kernel(kind: str, ks: KernelStatic, use_disk: bool = True):
    """The compiled kernel (a CuTe DSL ``JitCompiledFunction``), from memory, disk or compiled.

    Raises:
      Any CuTe DSL compilation error (a bug: every supported configuration compiles).
    """
    arch = target_arch()
    key = (kind, ks, arch)
    with _lock:
        fn = _mem.get(key)
        if fn is not None:
            return fn
        prefix = _prefix(kind, ks, arch)
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
                _record(kind, ks, arch, "disk", time.perf_counter() - t0)
            except Exception as e:  # noqa: BLE001 - a stale or broken file: recompile
                log.warning("cutedsl: cannot load %s (%s: %s); recompiling", path,
                            type(e).__name__, e)
                fn = None
        if fn is None:
            fn, secs = compile_kernel(kind, ks)
            _record(kind, ks, arch, "compile", secs)
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


def _record(kind: str, ks: KernelStatic, arch: str, source: str, seconds: float) -> None:
    rec = CompileRecord(kind, ks.tag(), arch, source, seconds)
    COMPILE_LOG.append(rec)
    log.info("cutedsl: %s kernel %s for %s: %s in %.2f s", kind, rec.tag, arch,
             "compiled" if source == "compile" else "loaded from disk", seconds)


def compile_seconds(kind: Optional[str] = None) -> float:
    """Total seconds spent compiling / loading kernels in this process (optionally one kind)."""
    return sum(r.seconds for r in COMPILE_LOG if kind is None or r.kind == kind)
