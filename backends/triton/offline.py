"""Offline compilation of the Triton backend's builds (no GPU needed): PTX, SASS, resources.

:func:`compile_offline` compiles any build of either kernel for an NVIDIA architecture with
Triton's bundled ptxas, with the signature the JIT gives a launch of the step functions on
16-byte aligned tensors (or on rows that are not: ``rows16=False``), and the same constexprs
and options the step functions launch with;
:func:`resource_usage` reads registers, stack and spills from the result. The backend's tests
use them to check the builds' resources and code shape.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from typing import Dict, Union

import torch
import triton

from kda.backends.triton import kda_decode, kda_decode_chunked
from kda.config import KdaConfig

#: Every build of both kernels, by name (:mod:`kda.backends.triton.policy` names them).
BUILDS = {**kda_decode.BUILDS, **kda_decode_chunked.BUILDS}

_DT = {torch.bfloat16: "bf16", torch.float32: "fp32"}
_STRIDES = ("stride_x", "stride_cs", "stride_fa", "stride_og", "stride_out", "stride_st")
#: The row tensors (kda.backend.ROW_TENSORS): their pointers and strides lose every
#: divisibility with ``rows16=False``.
_ROW_PTRS = ("x_ptr", "fa_ptr", "og_ptr", "out_ptr")
_ROW_STRIDES = ("stride_x", "stride_fa", "stride_og", "stride_out")


def compile_offline(cfg: KdaConfig, build: Union[str, "kda_decode.ItemBuild",
                                                 "kda_decode_chunked.ChunkedBuild"],
                    arch: int = 90, stride_divisible: bool = True, rows16: bool = True,
                    **options):
    """Compile ``build`` for ``cfg`` for an NVIDIA GPU of compute capability ``arch``, without
    a GPU, as the JIT would for a step on 16-byte aligned tensors.

    Args:
      cfg: the configuration.
      build: a build or its name (a key of :data:`BUILDS`).
      arch: the compute capability as an integer; 90 = sm_90a (H100/H200).
      stride_divisible: specialize the row/slot strides as multiples of 16 elements (the
        common case; the kernels' own alignment hints do not depend on it).
      rows16: the rows of x, f_a, output_gate and out are 16-byte aligned (the kernels'
        ``ROWS16``); False compiles the build a call on unaligned rows gets (an engine's
        packed projection at H % 8 != 0): their pointers and row strides without any
        divisibility, no row hint.
      options: Triton options that override the build's (num_warps, maxnreg, ...).

    Returns:
      Triton's CompiledKernel: ``.asm["ttir" | "ttgir" | "ptx" | "cubin"]``,
      ``.metadata.shared`` (see :func:`resource_usage` for registers and spills).

    Raises:
      KeyError: an unknown build name.
    """
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if isinstance(build, str):
        build = BUILDS[build]
    kernel = build.kernel
    consts = dict(build.constants(cfg, interp=False), ROWS16=rows16)
    opts = dict(build.options(interp=False), **options)
    ptr = {
        "x_ptr": "*bf16", "cw_ptr": "*" + _DT[cfg.conv_weight_dtype], "cb_ptr": "*fp32",
        "cs_ptr": "*" + _DT[cfg.conv_state_dtype], "fa_ptr": "*bf16", "fb_ptr": "*bf16",
        "beta_ptr": "*fp32" if cfg.beta_activated else "*bf16", "alog_ptr": "*fp32", "dtb_ptr": "*fp32", "st_ptr": "*" + _DT[cfg.state_dtype],
        "si_ptr": "*i32", "nacc_ptr": "*i32", "og_ptr": "*bf16",
        "nw_ptr": "*" + _DT[cfg.norm_weight_dtype], "out_ptr": "*bf16", "vrec_ptr": "*fp32",
        "kgrec_ptr": "*bf16", "scr_ptr": "*fp32", "ctr_ptr": "*i32"}
    sig, attrs = {}, {}
    for i, name in enumerate(kernel.arg_names):
        if name in consts:
            sig[name] = "constexpr"
        elif name in ptr:
            sig[name] = ptr[name]
            if rows16 or name not in _ROW_PTRS:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in ("scale", "norm_eps", "lower_bound"):
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
            if stride_divisible and name in _STRIDES and (rows16 or name not in _ROW_STRIDES):
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn=kernel, signature=sig, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=opts)


def resource_usage(compiled) -> Dict[str, int]:
    """Registers, spills, local memory, stack and shared memory of a compiled kernel, read
    from its cubin with the cuobjdump that Triton bundles (no GPU needed).

    Returns:
      {"regs", "stack", "local", "spill_stores", "spill_loads", "shared" (bytes except
      regs), "ptx_local" (ld/st.local instructions in the PTX)}; -1 where cuobjdump reports
      no figure.

    Raises:
      subprocess.CalledProcessError: cuobjdump fails.
    """
    from triton.backends.nvidia import compiler as nv_compiler

    cuobjdump = os.path.join(os.path.dirname(nv_compiler.__file__), "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        txt = subprocess.run([cuobjdump, "--dump-resource-usage", f.name], check=True,
                             capture_output=True, text=True).stdout

    def field(key):
        m = re.search(key + r":(\d+)", txt)
        return int(m.group(1)) if m else -1
    ptx = compiled.asm["ptx"]
    spill_st = sum(int(x) for x in re.findall(r"(\d+) bytes spill stores", txt))
    spill_ld = sum(int(x) for x in re.findall(r"(\d+) bytes spill loads", txt))
    return {"regs": field("REG"), "stack": field("STACK"), "shared": compiled.metadata.shared,
            "local": field("LOCAL"), "spill_stores": spill_st, "spill_loads": spill_ld,
            "ptx_local": len(re.findall(r"(ld|st)\.local", ptx))}


__all__ = ["BUILDS", "compile_offline", "resource_usage"]
