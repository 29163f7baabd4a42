"""What every backend implements: availability, per-config support, and a built step function.

A backend lives in ``backends/<name>/`` and exposes one object ``BACKEND`` (or, for a package
holding two kernels, ``BACKENDS``) of a :class:`Backend` subclass. The registry
(:mod:`kda.registry`) imports them lazily, so a backend whose dependencies are missing costs
nothing and reports why through :meth:`Backend.availability`.
"""

from __future__ import annotations

import abc
import os
import pathlib
from typing import Callable, List, Optional, Tuple

import torch

from kda.config import CONV_LAYOUTS, KdaArgs, KdaConfig, dtype_name

#: A built step: reads the validated args and writes out / state / conv_state / records.
StepFn = Callable[[KdaArgs], None]


class Backend(abc.ABC):
    """One implementation of the fused decode step.

    Subclasses set :attr:`name` and :attr:`description` and implement :meth:`probe`,
    :meth:`build` and, where they restrict configurations, :meth:`unsupported`.
    """

    #: Registry name, e.g. "triton".
    name: str = ""
    #: One line for the README's backend table and for logs.
    description: str = ""
    #: Devices this backend runs on ("cpu", "cuda").
    device_types: tuple = ("cuda",)

    @abc.abstractmethod
    def probe(self) -> Optional[str]:
        """None when the backend can run in this process, else the reason it cannot.

        Called once (by :meth:`availability`, which caches it and turns an exception into a
        reason), so it may import heavy modules and query devices.
        """

    def availability(self) -> Optional[str]:
        """:meth:`probe`'s answer, computed once; never raises."""
        cached = self.__dict__.get("_availability_cache")
        if cached is None:
            try:
                why = self.probe()
            except Exception as e:  # noqa: BLE001 - availability must not raise
                why = f"{self.name} availability check failed: {type(e).__name__}: {e}"
            cached = self.__dict__["_availability_cache"] = (why,)
        return cached[0]

    def unsupported(self, cfg: KdaConfig, device: torch.device) -> List[str]:
        """Reasons this backend cannot serve ``cfg`` on ``device``; empty when it can."""
        reasons = []
        if device.type not in self.device_types:
            reasons.append(f"{self.name} runs on {'/'.join(self.device_types)}, "
                           f"tensors are on {device.type}")
        return reasons

    @abc.abstractmethod
    def build(self, cfg: KdaConfig, device: torch.device) -> StepFn:
        """Return the step function for ``cfg`` (compiling or loading it once).

        Called only after :meth:`availability` is None and :meth:`unsupported` is empty.
        The returned function must not synchronize with the host, read device-side values on
        the host, or allocate per call beyond what the caching allocator serves (CUDA graphs).
        """


def kernel_config_reasons(cfg: KdaConfig, max_T: int) -> List[str]:
    """Reasons a compiled kernel instantiated for T in 1..``max_T`` cannot serve ``cfg``: T out
    of range, a window shorter than T + 2, no heads, gate_mode not 0/1, an unknown conv layout,
    a conv-state / conv-weight / norm-weight dtype other than bf16 or fp32. Shared by the CUDA
    and CuTe DSL backends (their gate MMA has 8 token columns)."""
    reasons = []
    if not 1 <= cfg.T <= max_T:
        reasons.append(f"T={cfg.T}: the kernel supports T in 1..{max_T} (the gate MMA has 8 "
                       "token columns)")
    if cfg.window < cfg.T + 2:
        reasons.append(f"window {cfg.window} < T + 2")
    if cfg.num_heads < 1:
        reasons.append("num_heads must be >= 1")
    if cfg.gate_mode not in (0, 1):
        reasons.append(f"gate_mode {cfg.gate_mode} is not 0 or 1")
    if cfg.conv_layout not in CONV_LAYOUTS:
        reasons.append(f"conv layout {cfg.conv_layout!r} is not one of {CONV_LAYOUTS}")
    for what, dt in (("conv_state", cfg.conv_state_dtype), ("conv_weight", cfg.conv_weight_dtype),
                     ("norm_weight", cfg.norm_weight_dtype)):
        if dt not in (torch.bfloat16, torch.float32):
            reasons.append(f"{what} dtype {dtype_name(dt)} is not bfloat16 / float32")
    return reasons


def cache_dir(name: str) -> pathlib.Path:
    """The folder ``name`` of the project's on-disk cache: ``$KDA_CACHE_DIR/<name>``, else
    ``~/.cache/kda/<name>``. The one place that reads ``KDA_CACHE_DIR``; its folders are
    ``cuda_ext`` (the CUDA extension, one subfolder per source fingerprint), ``cutedsl`` (the
    CuTe DSL kernels) and ``checkpoints`` (the serve tool's synthetic checkpoint). Nothing is
    created here."""
    root = os.environ.get("KDA_CACHE_DIR")
    base = pathlib.Path(root) if root else pathlib.Path.home() / ".cache" / "kda"
    return base / name


#: The tensors whose rows the GPU kernels stage or store in vectors (bf16 rows of a token):
#: their alignment picks the kernels' row path (:func:`row_bytes`).
ROW_TENSORS = ("x", "f_a", "output_gate", "out")


def row_bytes(args: KdaArgs) -> int:
    """16, 8, 4 or 2: the widest access (in bytes, at most 16) that every row of
    :data:`ROW_TENSORS` allows: the largest power of two up to 16 dividing each one's data
    address and, with more than one row, its row pitch in bytes. 16 is the common case (the
    kernels' 16-byte copies); an engine's packed projection with H % 8 != 0 heads gives less.

    Host metadata only (addresses and strides), a few integer operations per call; each GPU
    backend chooses the build it launches by it.
    """
    rows = [getattr(args, name) for name in ROW_TENSORS]
    return widest_access([t.data_ptr() for t in rows],
                         [t.stride(0) * t.element_size() for t in rows if t.shape[0] > 1])


def widest_access(addresses, pitches) -> int:
    """The rule of :func:`row_bytes` on plain integers: the largest power of two up to 16 that
    divides every address and every row pitch (bytes; pass no pitch for single-row tensors)."""
    acc = 16
    for v in addresses:
        acc |= v
    for v in pitches:
        acc |= v
    return acc & -acc


def gpu_reason(accept: Callable[[Tuple[int, int]], bool], need: str) -> Optional[str]:
    """None when torch sees a CUDA device whose compute capability ``accept`` takes, else why not.

    Args:
      accept: predicate on a (major, minor) capability, e.g. ``lambda cc: cc >= (9, 0)``.
      need: what the backend needs, for the message (e.g. "an sm_90 GPU (H100 / H200)").
    """
    if not torch.cuda.is_available():
        return "no CUDA device visible to torch"
    if not any(accept(torch.cuda.get_device_capability(i)) for i in range(torch.cuda.device_count())):
        return f"needs {need}"
    return None


def current_stream_handle(device: torch.device) -> int:
    """The raw handle of ``device``'s current CUDA stream (0 off CUDA, where work runs in
    order): one C call (``torch._C._cuda_getCurrentRawStream``), the per-launch way to key a
    kernel's per-stream buffers."""
    if device.type != "cuda":
        return 0
    index = device.index if device.index is not None else torch.cuda.current_device()
    try:
        return torch._C._cuda_getCurrentRawStream(index)
    except AttributeError:  # pragma: no cover - older/newer torch
        return torch.cuda.current_stream(index).cuda_stream


class StreamBuffers:
    """Device buffers a kernel keeps between launches, one per CUDA stream it is launched on,
    so that launches on two streams at once (two overlapped micro-batches) never share one;
    graphs captured on one stream share that stream's buffer.

    ``get(n)`` returns the current stream's buffer of at least ``n`` elements, making (or
    growing) it on first need; outgrown buffers stay alive, so graphs captured before the
    growth keep valid pointers. With ``zeroed`` (counters that the kernel leaves at zero after
    every launch) a buffer must hold zeros before its first launch. One made during CUDA-graph
    capture would hold garbage until that graph's first replay (``torch.zeros`` only records a
    fill node there), and another graph captured on the same stream, or an eager launch, could
    run first. So zeroed buffers are never made during capture: the constructor (outside
    capture) and each eager ``get`` keep one zeroed spare, and a stream first seen during
    capture (``torch.cuda.graph``'s own capture stream) takes it. Buffers without ``zeroed``
    (scratch written before it is read) are made during capture too, from the graph's pool.

    Args (constructor):
      device: the device. dtype: the buffers' dtype. zeroed: see above. what: names the buffer
      in errors. min_elems: the smallest buffer made.

    Raises (``get``):
      RuntimeError: a zeroed buffer is needed during capture and no large enough spare was
        made by an eager call (run one eager step with at least this batch first).
    """

    def __init__(self, device: torch.device, dtype: torch.dtype, zeroed: bool, what: str,
                 min_elems: int = 1):
        self.device = torch.device(device)
        self.dtype = dtype
        self.zeroed = zeroed
        self.what = what
        self.min_elems = min_elems
        self.kept: dict = {}          # stream handle -> [buffer], newest (largest) last
        self.spare: Optional[torch.Tensor] = None
        if zeroed and not (self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            # (made with the step, so that a graph captured before any eager step can run)
            self.spare = torch.zeros(min_elems, dtype=dtype, device=self.device)

    def current(self) -> Optional[torch.Tensor]:
        """The current stream's newest buffer (None before its first ``get``)."""
        kept = self.kept.get(current_stream_handle(self.device))
        return kept[-1] if kept else None

    def newest(self) -> dict:
        """{stream handle: its newest buffer} (for tests)."""
        return {k: v[-1] for k, v in self.kept.items() if v}

    def get(self, n: int) -> torch.Tensor:
        kept = self.kept.setdefault(current_stream_handle(self.device), [])
        fits = bool(kept) and kept[-1].numel() >= n
        if fits and (self.spare is not None or not self.zeroed):
            return kept[-1]                       # the per-launch path
        capturing = self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        if not fits:
            cap = max(n, self.min_elems, 2 * kept[-1].numel() if kept else 0)
            if not self.zeroed:
                kept.append(torch.empty(cap, dtype=self.dtype, device=self.device))
            elif capturing:
                if self.spare is None or self.spare.numel() < n:
                    raise RuntimeError(
                        f"KDA: {self.what} for a stream first used during CUDA-graph capture "
                        f"must be zeroed before the capture, and no eager step left a spare of "
                        f"{n} elements; run one eager step with at least this batch before "
                        "capturing")
                kept.append(self.spare)
                self.spare = None
            else:
                kept.append(torch.zeros(cap, dtype=self.dtype, device=self.device))
        # an eager call keeps a zeroed spare as large as this stream's buffer
        size = kept[-1].numel()
        if self.zeroed and not capturing and (self.spare is None or self.spare.numel() < size):
            self.spare = torch.zeros(size, dtype=self.dtype, device=self.device)
        return kept[-1]
