"""The ``cutedsl`` and ``cutedsl_wide`` backends: the fused KDA decode step as one CuTe DSL
kernel launch (nvidia-cutlass-dsl 4.8.1).

A kernel of the family is compiled for a :class:`kda.backends.cutedsl.problem.Problem` (the
step's shapes and dtypes) and a :class:`kda.backends.cutedsl.schedule.Schedule` (how the
kernel lays out the work). ``cutedsl_wide`` runs one CTA per (request, head) item
(:func:`kda.backends.cutedsl.schedule.wide`). ``cutedsl`` runs the schedule its policy picks
for the batch's load on the GPU it runs on (:func:`kda.backends.cutedsl.policy.schedule_for`:
the GPU's measured table, else the default in SM waves): each item on a cluster of CTAs at
small batches, persistent CTAs streaming the state pages through a shared-memory ring above,
or one CTA per item where that measured faster. Every schedule computes every value in the
same order, so the two backends produce bit-identical outputs, states, windows and records.
Design: ``docs/design.md``; compilation and caching: :mod:`kda.backends.cutedsl.cache`.

Host path: a built step keeps one ctypes buffer holding every kernel argument (17 pointers,
the strides, R, the runtime scalars scale / norm_eps / lower_bound, the streamed kernel's
grid, the stream) and the
packed argument array of the compiled host launcher; a call writes the new values into the
buffer with one slice assignment and calls the launcher (which issues ``cuLaunchKernelEx``
on torch's current stream). No device values are read, nothing is allocated, nothing is
synchronized, so the step can be captured in a CUDA graph.

Rows: the kernels are compiled for rows of x, f_a, output_gate and out that are 16-byte
aligned (:attr:`Problem.row_bytes`). A call whose rows are not (an engine's packed
projection with H % 8 != 0 heads; :func:`kda.backend.row_bytes`, from the addresses and
strides the launcher reads anyway) runs the build for its alignment, compiled (or loaded from
the cache) on the first such call: run one eager step with those tensors before capturing a
CUDA graph, as for every new batch size.

Every kernel is launched with programmatic dependent launch.

Environment:
  KDA_CACHE_DIR       compile cache root (kernels go to ``$KDA_CACHE_DIR/cutedsl``;
                      default ``~/.cache/kda/cutedsl``).
  CUTE_DSL_ARCH       target architecture when compiling without a GPU (e.g. sm_90a).
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import os
import struct
import threading
from typing import List, Optional

import torch

from kda.backend import (Backend, StepFn, current_stream_handle, gpu_reason,
                         kernel_config_reasons, widest_access)
from kda.backends.cutedsl import policy, tables
from kda.backends.cutedsl import schedule as S
from kda.backends.cutedsl.problem import MAX_T, Problem
from kda.backends.cutedsl.static import SmemPlan
from kda.config import KdaArgs, KdaConfig

log = logging.getLogger("kda")

_import_lock = threading.Lock()
_import_error: Optional[str] = None
_imported = False


#: The nvidia-cutlass-dsl release the kernels are written for and measured with (the
#: ``cutedsl`` extra's pin); another one is imported with a warning.
TESTED_CUTE_DSL = "4.8.1"


def installed_release() -> Optional[str]:
    """The installed nvidia-cutlass-dsl's version, or None (no or unreadable distribution
    metadata). Never raises."""
    from importlib.metadata import version
    try:
        return version("nvidia-cutlass-dsl")
    except Exception:  # noqa: BLE001 - metadata missing or broken: nothing to say
        return None


def version_note(version: Optional[str]) -> Optional[str]:
    """The warning for an installed nvidia-cutlass-dsl ``version`` other than
    :data:`TESTED_CUTE_DSL` (None: that version, or unknown)."""
    if version is None or version.split("+", 1)[0] == TESTED_CUTE_DSL:
        return None
    return (f"nvidia-cutlass-dsl {version} is installed; the cutedsl kernels are written for and "
            f"tested with {TESTED_CUTE_DSL} (the cutedsl extra's pin): check a new release with "
            "the GPU tests before serving with it")


def import_cutedsl() -> Optional[str]:
    """Import CuTe DSL once (setting ``CUTE_DSL_ARCH=sm_90a`` when no GPU is visible); an
    nvidia-cutlass-dsl other than :data:`TESTED_CUTE_DSL` is logged as a warning once.

    Returns None on success, else the reason it cannot be imported. Never raises.
    """
    global _imported, _import_error
    with _import_lock:
        if _imported:
            return _import_error
        _imported = True
        try:
            if "CUTE_DSL_ARCH" not in os.environ and not torch.cuda.is_available():
                os.environ["CUTE_DSL_ARCH"] = "sm_90a"
            import cutlass  # noqa: F401
            import cutlass.cute  # noqa: F401
            note = version_note(installed_release())
            if note is not None:
                log.warning("cutedsl: %s", note)
        except ImportError as e:
            _import_error = f"nvidia-cutlass-dsl not installed ({e})"
        except Exception as e:  # noqa: BLE001 - availability must not raise
            _import_error = f"cannot import CuTe DSL: {type(e).__name__}: {e}"
        return _import_error


def device_name(device_index: int) -> str:
    """The name of CUDA device ``device_index`` (what its schedule table is keyed by)."""
    return torch.cuda.get_device_name(device_index)


def sm_count(device_index: int) -> int:
    """The multiprocessors of CUDA device ``device_index``."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


_logged_tables = set()


def _log_table_once(device_index: int, sms: int) -> None:
    """Log once per device which schedule table ``cutedsl`` uses there."""
    if device_index not in _logged_tables:
        _logged_tables.add(device_index)
        log.info("%s", tables.describe(device_name(device_index), sms))


def _f32_bits(x: float) -> int:
    return struct.unpack("<I", struct.pack("<f", float(x)))[0]


def _set_carveout(compiled, smem_bytes: int, device_index: int) -> bool:
    """Best effort: the shared-memory carveout hint for 2 CTAs/SM (the rest stays L1).

    The CuTe DSL CUDA-library loader applies the kernel's max-dynamic-smem attribute but not
    the carveout hint given at launch configuration, so it is set here on the loaded kernel.
    Without it the driver still picks a configuration for the kernel's occupancy.
    """
    try:
        import cuda.bindings.runtime as rt

        from kda.backends.cutedsl.static import carveout_percent

        pct = carveout_percent(smem_bytes)
        lib = compiled.library
        ok = False
        for name in (compiled.kernel_info or {}):
            err, kern = rt.cudaLibraryGetKernel(lib, name.encode())
            if err != rt.cudaError_t.cudaSuccess:
                continue
            (err,) = rt.cudaKernelSetAttributeForDevice(
                kern, rt.cudaFuncAttribute.cudaFuncAttributePreferredSharedMemoryCarveout, pct,
                device_index)
            ok = ok or err == rt.cudaError_t.cudaSuccess
        return ok
    except Exception:  # noqa: BLE001 - a hint only
        return False


class _Launcher:
    """The step function of one (schedule, config, device): fills the argument buffer and
    launches.

    A call on rows of another alignment than its build's (:func:`kda.backend.row_bytes`) runs
    the build for that alignment (made on first need, shared by the launchers of every
    alignment).

    Args (constructor):
      sched: the :class:`Schedule`. cfg: the config. device: a CUDA device. compiled: the CuTe
      DSL ``JitCompiledFunction`` from :func:`kda.backends.cutedsl.cache.get_kernel`. pb: its
      :class:`Problem`.
    """

    def __init__(self, sched: S.Schedule, cfg: KdaConfig, device: torch.device, compiled,
                 pb: Problem):
        self.sched = sched
        self.cfg = cfg
        self.H, self.T = cfg.num_heads, cfg.T
        self.device_index = device.index if device.index is not None else torch.cuda.current_device()
        self.device = torch.device("cuda", self.device_index)
        self.exe = compiled.to(self.device_index)
        from kda.backends.cutedsl import args as A
        from kda.backends.cutedsl.scheduler import ctas

        self.ctas = ctas            # the streamed kernels' grid (scheduler.ctas)
        names = A.arg_names()
        self.nargs = len(names)
        self.buf = (ctypes.c_uint64 * self.nargs)()
        base = ctypes.addressof(self.buf)
        self.addrs = [base + 8 * i for i in range(self.nargs)]
        idx = {n: i for i, n in enumerate(names)}
        # the scalars read off a call follow the operands (args.SCALARS' order)
        first = len(A.OPERANDS)
        assert names[first:first + len(A.HOST_SCALARS)] == list(A.HOST_SCALARS)
        self.host_scalars = tuple(A.HOST_SCALARS.values())
        # the row tensors (x, f_a, output_gate, out) and their pitches: kda.backend.row_bytes
        self.row_ptrs = tuple(idx[n] for n in ("x", "f_a", "output_gate", "out"))
        self.row_pitches = tuple(idx[n] for n in ("x_rs", "fa_rs", "og_rs", "out_rs"))
        self.i_stream = idx["stream"]
        self.i_ctas = idx["ctas"]
        # the multiprocessors, for the streamed kernel's grid (scheduler.ctas)
        self.sms = sm_count(self.device_index)
        lb = cfg.lower_bound if cfg.lower_bound is not None else 0.0
        self.buf[idx["scale"]] = _f32_bits(cfg.scale)
        self.buf[idx["eps"]] = _f32_bits(cfg.norm_eps)
        self.buf[idx["lb"]] = _f32_bits(lb)
        self.pb = pb
        # the wide kernel's shared memory leaves room for 2 CTAs per SM with the carveout hint
        self.carveout_set = sched.rows == S.Rows.CTA and _set_carveout(
            compiled, SmemPlan(pb.T).total, self.device_index)
        # fast path: the launcher's packed argument array is built once (its entries are the
        # fixed addresses of self.buf's slots); fall back to the executor's own packing.
        self._capi = None
        try:
            packed = self.exe._get_invoke_packed_args(self.addrs)
            self._packed = (ctypes.c_void_p * len(packed))(*packed)
            self._capi = self.exe.capi_func
            self._result = self.exe.cuda_result
        except AttributeError:
            self._capi = None
        self.by_rows = {pb.row_bytes: self}     # the launchers by row alignment

    def for_rows(self, row_bytes: int) -> "_Launcher":
        """The launcher of the build for rows of ``row_bytes`` alignment (compiled or loaded
        on first need)."""
        launcher = self.by_rows.get(row_bytes)
        if launcher is None:
            from kda.backends.cutedsl import cache

            pb = dataclasses.replace(self.pb, row_bytes=row_bytes)
            launcher = _Launcher(self.sched, self.cfg, self.device,
                                 cache.get_kernel(pb, self.sched), pb)
            launcher.by_rows = self.by_rows
            self.by_rows[row_bytes] = launcher
        return launcher

    def _launch(self) -> None:
        if self._capi is not None:
            self._capi(self._packed)
            if self._result is not None and self._result.value != 0:
                raise RuntimeError(f"cutedsl {self.sched.name} launch failed: CUDA error "
                                   f"{self._result.value}")
        else:
            self.exe.run_compiled_program(self.addrs)

    def __call__(self, a: KdaArgs) -> None:
        R = a.state_indices.shape[0]
        if R == 0:
            return
        x = a.x.data_ptr()
        # the kernels take the record's tensors in its field order; an absent one (None) is
        # never read: x's address stands in
        vals = [x if t is None else t.data_ptr() for t in a] + [get(a) for get in
                                                                 self.host_scalars]
        # kda.backend.row_bytes, from the addresses and row pitches (bf16 rows) read above
        rows = widest_access([vals[i] for i in self.row_ptrs],
                             [2 * vals[i] for i in self.row_pitches] if R * self.T > 1 else ())
        launcher = self if rows == self.pb.row_bytes else self.for_rows(rows)
        launcher.buf[0:len(vals)] = vals
        launcher.buf[launcher.i_ctas] = self.ctas(self.sched, R * self.H, self.sms)
        launcher.buf[launcher.i_stream] = current_stream_handle(self.device)
        launcher._launch()


class _CuteDslBackend(Backend):
    """Shared availability / support checks of the two CuTe DSL backends."""

    device_types = ("cuda",)

    def probe(self) -> Optional[str]:
        """None with a CUDA sm_90+ device and CuTe DSL importable, else the reason."""
        return (gpu_reason(lambda cc: cc >= (9, 0),
                           "an sm_90+ GPU (griddepcontrol, clusters, mma.sync bf16, cp.async)")
                or import_cutedsl())

    def unsupported(self, cfg: KdaConfig, device: torch.device) -> List[str]:
        """Reasons ``cfg`` cannot run: T outside 1..8, window < T+2, unknown layout / dtypes."""
        reasons = super().unsupported(cfg, device)
        if device.type == "cuda" and torch.cuda.is_available():
            cap = torch.cuda.get_device_capability(device)
            if cap < (9, 0):
                reasons.append(f"needs sm_90+, device is sm_{cap[0]}{cap[1]}")
        reasons += kernel_config_reasons(cfg, MAX_T)
        return reasons

    @staticmethod
    def launcher(sched: S.Schedule, cfg: KdaConfig, device: torch.device) -> "_Launcher":
        """Compile (or load) the kernel of ``cfg`` with ``sched`` and return its launcher."""
        why = import_cutedsl()
        if why is not None:
            raise RuntimeError(why)
        from kda.backends.cutedsl import cache

        pb = Problem.from_config(cfg)
        return _Launcher(sched, cfg, device, cache.get_kernel(pb, sched), pb)


class KdaBackend(_CuteDslBackend):
    """``cutedsl``: the schedule :func:`kda.backends.cutedsl.policy.schedule_for` picks by the
    batch's load, T, the state dtype and the GPU (its measured table, else the default in SM
    waves).

    The step reads only the host-side batch size to choose, so a CUDA graph captured at one
    batch size replays the kernel chosen for it; every schedule the policy may pick for the
    configuration is compiled when the step is built.
    """

    name = "cutedsl"
    description = ("CuTe DSL: each (request, head) on a cluster of 2-8 CTAs (value rows split, "
                   "decays and outputs exchanged through distributed shared memory) at small "
                   "batches, persistent CTAs streaming the state pages through a shared-memory "
                   "ring above (prep warps ahead of consumer warps, or each consumer group "
                   "preparing its own items; CTAs of a few items in blocks of requests), one "
                   "CTA per item where that measured faster; the schedule by SM waves or the "
                   "GPU's measured table; mma.sync gate, PDL")

    def build(self, cfg: KdaConfig, device: torch.device) -> StepFn:
        pb = Problem.from_config(cfg)
        index = device.index if device.index is not None else torch.cuda.current_device()
        sms = sm_count(index)
        table = tables.for_device(device_name(index))
        if table is not None and table.sms != sms:
            # (a GPU of this name with other multiprocessors: a MIG slice, a variant)
            table = None
        _log_table_once(index, sms)
        launchers = {s: self.launcher(s, cfg, device)
                     for s in policy.schedules(pb, sms, cfg.early_reads, table)}
        chosen = {}         # R -> the schedule for R requests
        by_batch = {}       # R -> its launcher

        def choose(R: int) -> S.Schedule:
            """The schedule this step runs for a batch of ``R`` requests."""
            s = chosen.get(R)
            if s is None:
                s = chosen[R] = policy.schedule_for(pb, R * pb.H, sms, cfg.early_reads, table)
            return s

        def step(a: KdaArgs) -> None:
            R = a.state_indices.shape[0]
            launcher = by_batch.get(R)
            if launcher is None:
                launcher = by_batch[R] = launchers[choose(R)]
            launcher(a)

        step.launchers = launchers
        step.choose = choose
        return step


class KdaWideBackend(_CuteDslBackend):
    """``cutedsl_wide``: one CTA per item (:func:`kda.backends.cutedsl.schedule.wide`)."""

    name = "cutedsl_wide"
    description = "CuTe DSL wide kernel: one 256-thread CTA per (request, head), mma.sync gate"

    def build(self, cfg: KdaConfig, device: torch.device) -> StepFn:
        return self.launcher(S.wide(Problem.from_config(cfg)), cfg, device)


def compile_seconds(name: Optional[str] = None) -> float:
    """Seconds this process spent compiling / loading CuTe DSL kernels (for the benchmark;
    optionally those of one schedule name)."""
    from kda.backends.cutedsl import cache
    return cache.compile_seconds(name)
