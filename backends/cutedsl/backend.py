"""The ``cutedsl`` (streamed) and ``cutedsl_wide`` (one CTA per item) backends.

Both run the fused KDA decode step as one CuTe DSL kernel (nvidia-cutlass-dsl 4.8.1) whose
per-item math is shared (:mod:`kda.backends.cutedsl.common`), so the two produce bit-identical
outputs, states, windows and records. See ``docs/kda-stream-design.md`` for the design and
:mod:`kda.backends.cutedsl.cache` for compilation and caching.

Host path: a built step keeps one ctypes buffer holding every kernel argument (17 pointers,
the strides, R, the runtime scalars scale / norm_eps / lower_bound, the stream) and the
packed argument array of the compiled host launcher; a call writes the new values into the
buffer with one slice assignment and calls the launcher (which issues ``cuLaunchKernelEx``
on torch's current stream). No device values are read, nothing is allocated, nothing is
synchronized, so the step can be captured in a CUDA graph.

Environment:
  KDA_CUTEDSL_PDL     "1" (default): programmatic dependent launch, dependents triggered
                      after each CTA's last write; "early": triggered after the prologue's
                      loads (the kernels read nothing before their griddepcontrol.wait, so a
                      successor of the same kind stays correct; not measured faster); "0":
                      no PDL.
  KDA_CUTEDSL_PREFETCH  streamed kernel: L2-prefetch distance in items (2..8; 0 = off, default).
  KDA_CUTEDSL_ITEMS_PER_CTA  streamed kernel: at most k items per CTA, ceil(R*H / k) CTAs but
                      never fewer than 2 per SM (0 = persistent grid; default by T:
                      ITEMS_PER_CTA).
  KDA_CUTEDSL_FB_SMEM  streamed kernel at T=1: "1" walks items head-major and stages each
                      head's f_b rows in shared memory once per head instead of loading the
                      gate MMA's A fragments from L2 for every item; "0" does not (default:
                      FB_SMEM; no effect at T > 1 or on the wide kernel).
  (KDA_CUTEDSL_PDL / _PREFETCH / _ITEMS_PER_CTA / _FB_SMEM are read when a step is built: kda_decode /
  KdaDecode keep built steps for the process, so a later change needs a new process or a new
  build().)
  KDA_CACHE_DIR       compile cache root (kernels go to ``$KDA_CACHE_DIR/cutedsl``;
                      default ``~/.cache/kda/cutedsl``).
  CUTE_DSL_ARCH       target architecture when compiling without a GPU (e.g. sm_90a).
"""

from __future__ import annotations

import ctypes
import os
import struct
import threading
from typing import List, Optional

import torch

from kda.backend import (Backend, StepFn, current_stream_handle, flag_from_env, gpu_reason,
                         items_per_cta_from_env, kernel_config_reasons,
                         prefetch_distance_from_env, stream_grid)
from kda.config import KdaArgs, KdaConfig

#: Tokens per request the kernels support (the gate MMA has 8 token columns).
MAX_T = 8

_import_lock = threading.Lock()
_import_error: Optional[str] = None
_imported = False


def import_cutedsl() -> Optional[str]:
    """Import CuTe DSL once (setting ``CUTE_DSL_ARCH=sm_90a`` when no GPU is visible).

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
        except ImportError as e:
            _import_error = f"nvidia-cutlass-dsl not installed ({e})"
        except Exception as e:  # noqa: BLE001 - availability must not raise
            _import_error = f"cannot import CuTe DSL: {type(e).__name__}: {e}"
        return _import_error


def pdl_mode() -> tuple:
    """(pdl, early trigger) from ``KDA_CUTEDSL_PDL``: "0" off, "1" (default) on with the
    dependents' trigger after each CTA's last write, "early" on with the trigger right after
    the prologue's loads (see :class:`kda.backends.cutedsl.static.KernelStatic`)."""
    v = os.environ.get("KDA_CUTEDSL_PDL", "1").strip().lower()
    if v in ("0", "off", "false", "no"):
        return False, False
    return True, v == "early"


#: Default L2-prefetch distance of the streamed kernel, in items (``KDA_CUTEDSL_PREFETCH``).
#: Off: on the H200 (c3bcd08) distance 2 / 3 took R=128 T=1 from 0.768 to 0.625 / 0.584 of
#: the floor.
PREFETCH_DISTANCE = 0

#: Default items per CTA of the streamed kernel by T (``KDA_CUTEDSL_ITEMS_PER_CTA`` overrides;
#: 0 = persistent grid; T not listed: 1). Measured on the H200 (H=32, fraction of the floor
#: at R=128 / R=512, persistent grid in brackets): 95e0754 T=1 k=4 0.773 / 0.829 (0.759 /
#: 0.807), T=2 k=2 0.748 / 0.761 (0.726 / 0.757), T=5 k=1 0.800 / 0.825 (0.751 / 0.774);
#: checked at 5f303cd with these defaults: T=1 0.781 / 0.838 (0.773 / 0.823), T=2 0.755 /
#: 0.775 (0.739 / 0.772), T=3 0.784 / 0.816 (0.743 / 0.774), T=5 0.807 / 0.827 (0.765 /
#: 0.791). With one item per CTA a CTA prefetches nothing of its own: the overlap comes
#: from the other CTA on the SM and from the hardware starting a CTA whenever one retires.
ITEMS_PER_CTA = {1: 4, 2: 2}


#: Default of ``KDA_CUTEDSL_FB_SMEM``: the streamed kernel at T=1 walks items head-major and
#: stages each head's f_b rows in shared memory (:class:`kda.backends.cutedsl.static.KernelStatic`).
#: Off: on the H200 (be8156f, H=32, T=1, step times at R = 32 / 128 / 256 / 512, two repeats
#: each) 48.2 / 169.9 / 328.8 / 644.7 us with 4 items per CTA against 48.9 / 170.0 / 327.7 /
#: 635.6 without (R=512 1.4% slower), 48.3 / 171.0 / 331.9 / 654.7 on the persistent grid.
#: The CUDA kernel gains 4-6% from the same staging; this kernel already ran the gate (and
#: its f_b loads) before waiting for the item's staging, which the staged rows must follow.
FB_SMEM = False


def page_last(kind: str, T: int) -> bool:
    """Whether the kernel ``kind`` ("wide" / "stream") at ``T`` tokens commits the (first)
    item's state page last, in its own cp.async group
    (:attr:`kda.backends.cutedsl.static.KernelStatic.page_last`): always for the wide kernel,
    for the streamed one from T=3 (where its CTAs take one item each by default).

    Measured on the H200 (H=32, step times at R = 32 / 128 / 512 in us, page last against
    one group, two interleaved repeats each; ``docs/results/2026-11-30-h200-4fdb6b0`` and
    ``-4fdb6b0-t23``): wide T=1 164.3 / 627.3 at R = 128 / 512 against 168.2 / 645.2, T=2
    67.0 / 242.9 / 998 against 68.3 / 250.2 / 989, T=3 84.7 / 316.2 / 1214.2 against 86.0 /
    317.6 / 1225.3, T=5 unchanged; stream T=3 90.7 / 329.4 / 1263.4 against 91.0 / 335.9 /
    1281.4, T=5 0.1% faster, T=1 within 0.4% either way, but T=2 (2 items per CTA) 73.4 /
    270.9 / 1055.2 against 71.1 / 260.9 / 1026.3, 2.8-3.8% slower, so not below T=3.
    """
    return kind != "stream" or T >= 3


def prefetch_distance() -> int:
    """The streamed kernel's L2-prefetch distance from ``KDA_CUTEDSL_PREFETCH`` (0 = off;
    default :data:`PREFETCH_DISTANCE`; see :class:`kda.backends.cutedsl.static.KernelStatic`).

    Raises:
      ValueError: the value is not one of :data:`kda.backend.PREFETCH_DISTANCES`.
    """
    return prefetch_distance_from_env("KDA_CUTEDSL_PREFETCH", PREFETCH_DISTANCE)


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
    """The step function of one (kind, config, device): fills the argument buffer and launches.

    Args (constructor):
      kind: "stream" or "wide". cfg: the config. device: a CUDA device. compiled: the
      CuTe DSL ``JitCompiledFunction`` from :func:`kda.backends.cutedsl.cache.get_kernel`. ks: its
      :class:`kda.backends.cutedsl.static.KernelStatic`.
    """

    def __init__(self, kind: str, cfg: KdaConfig, device: torch.device, compiled, ks):
        from kda.backends.cutedsl import cache
        from kda.backends.cutedsl.static import SmemPlan

        self.kind = kind
        self.cfg = cfg
        self.H, self.T = cfg.num_heads, cfg.T
        self.device_index = device.index if device.index is not None else torch.cuda.current_device()
        self.device = torch.device("cuda", self.device_index)
        self.exe = compiled.to(self.device_index)
        names = cache.arg_names(kind)
        self.nargs = len(names)
        self.buf = (ctypes.c_uint64 * self.nargs)()
        base = ctypes.addressof(self.buf)
        self.addrs = [base + 8 * i for i in range(self.nargs)]
        idx = {n: i for i, n in enumerate(names)}
        self.i_scalars = idx["R"]
        self.i_stream = idx["stream"]
        lb = cfg.lower_bound if cfg.lower_bound is not None else 0.0
        self.buf[idx["scale"]] = _f32_bits(cfg.scale)
        self.buf[idx["eps"]] = _f32_bits(cfg.norm_eps)
        self.buf[idx["lb"]] = _f32_bits(lb)
        self.ks = ks
        self.carveout_set = _set_carveout(compiled, SmemPlan(ks.T, ks.fb_smem).total,
                                          self.device_index)
        self.n_sm = torch.cuda.get_device_properties(self.device_index).multi_processor_count
        self.max_ctas = 2 * self.n_sm
        self.items_per_cta = 0
        if kind == "stream":
            self.items_per_cta = items_per_cta_from_env("KDA_CUTEDSL_ITEMS_PER_CTA",
                                                        ITEMS_PER_CTA.get(self.T, 1))
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

    def _launch(self) -> None:
        if self._capi is not None:
            self._capi(self._packed)
            if self._result is not None and self._result.value != 0:
                raise RuntimeError(f"cutedsl {self.kind} launch failed: CUDA error "
                                   f"{self._result.value}")
        else:
            self.exe.run_compiled_program(self.addrs)

    def __call__(self, a: KdaArgs) -> None:
        R = a.state_indices.shape[0]
        if R == 0:
            return
        x = a.x.data_ptr()
        opt = lambda t: x if t is None else t.data_ptr()  # noqa: E731 - absent: never read
        vals = [
            x, a.conv_weight.data_ptr(), opt(a.conv_bias), a.conv_state.data_ptr(),
            a.f_a.data_ptr(), a.f_b.data_ptr(), a.beta.data_ptr(), a.A_log.data_ptr(),
            a.dt_bias.data_ptr(), a.state.data_ptr(), a.state_indices.data_ptr(),
            opt(a.num_accepted_tokens), a.output_gate.data_ptr(), a.norm_weight.data_ptr(),
            a.out.data_ptr(), opt(a.v_record), opt(a.kg_record),
            R, a.state.shape[0], a.x.stride(0), a.f_a.stride(0), a.beta.stride(0),
            a.output_gate.stride(0), a.out.stride(0), a.state.stride(0), a.conv_state.stride(0),
        ]
        self.buf[0:len(vals)] = vals
        if self.kind == "stream":
            self.buf[self.i_stream - 1] = stream_grid(R * self.H, self.max_ctas, self.items_per_cta)
        self.buf[self.i_stream] = current_stream_handle(self.device)
        self._launch()


class _CuteDslBackend(Backend):
    """Shared availability / support checks of the two CuTe DSL kernels."""

    kind = ""
    device_types = ("cuda",)

    def probe(self) -> Optional[str]:
        """None with a CUDA sm_90+ device and CuTe DSL importable, else the reason."""
        return (gpu_reason(lambda cc: cc >= (9, 0),
                           "an sm_90+ GPU (griddepcontrol, mma.sync bf16, cp.async)")
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

    def build(self, cfg: KdaConfig, device: torch.device) -> StepFn:
        """Compile (or load) the kernel for ``cfg`` and return its step function (a _Launcher)."""
        why = import_cutedsl()
        if why is not None:
            raise RuntimeError(why)
        from kda.backends.cutedsl import cache
        from kda.backends.cutedsl.static import KernelStatic

        pdl, early = pdl_mode()
        stream = self.kind == "stream"
        ks = KernelStatic.from_config(cfg, pdl=pdl, pdl_early=early,
                                      prefetch=prefetch_distance() if stream else 0,
                                      fb_smem=stream and cfg.T == 1
                                      and flag_from_env("KDA_CUTEDSL_FB_SMEM", FB_SMEM),
                                      page_last=page_last(self.kind, cfg.T))
        compiled = cache.get_kernel(self.kind, ks)
        return _Launcher(self.kind, cfg, device, compiled, ks)


class KdaStreamBackend(_CuteDslBackend):
    """``cutedsl``: the streamed kernel (:mod:`kda.backends.cutedsl.stream`); each CTA walks a
    contiguous item range (a few items by default, see :data:`ITEMS_PER_CTA`)."""

    name = "cutedsl"
    kind = "stream"
    description = ("CuTe DSL streamed kernel: CTAs walking item ranges (4 / 2 / 1 items at T = "
                   "1 / 2 / >= 3 by default), next item's state page and rows prefetched with "
                   "cp.async during the recurrence, mma.sync gate, PDL")


class KdaWideBackend(_CuteDslBackend):
    """``cutedsl_wide``: one CTA per item (:mod:`kda.backends.cutedsl.wide`)."""

    name = "cutedsl_wide"
    kind = "wide"
    description = "CuTe DSL wide kernel: one 256-thread CTA per (request, head), mma.sync gate"


def compile_seconds(kind: Optional[str] = None) -> float:
    """Seconds this process spent compiling / loading CuTe DSL kernels (for the benchmark)."""
    from kda.backends.cutedsl import cache
    return cache.compile_seconds(kind)
