"""Compile both CuTe DSL kernels for sm_90a on a machine without a GPU, across every axis.

Every configuration axis (T in {1, 2, 3, 5, 7, 8}, both conv layouts, both gates, gate_mode
0/1, conv bias, record mode, conv_state fp32, bf16 conv / norm weights, odd head counts, long
windows) is exercised by the wide kernel, built as the backend builds it, through a covering
set of configurations (the full product would take too long on 2 cores), and by the split
kernel on a subset per cluster size: C = 2, 4 and 8 each meet T = 1 and T > 1 with and
without record mode and most other axes.
The engine-facing forms (rows of x, f_a, output_gate and out aligned to 8, 4 or 2 bytes only,
an activated fp32 beta) are compiled for both kernels on a few configurations, with the loads
their build must use. For each compiled kernel the PTX is checked for the instructions the
design relies on (wide:
tensor-core gate MMA, 16-byte cp.async staging, 16-byte state stores, griddepcontrol with the
trigger after a GPU-scope fence; split: its share of the gate MMA, one bulk copy of the state
rows after the PDL wait plus the f_b row copies, st.async exchanges, one 16-byte store per
state chunk, pass and token) and the cubin's resource usage (``cuobjdump``; skipped when it
cannot be found). Also checked without a GPU: the runtime scalars (scale, norm_eps,
lower_bound) are not part of the compile key, the wide kernel's shared-memory plan fits two
CTAs per SM, the on-disk cache round-trips, the host launcher packs every argument, and
``cutedsl`` builds every kernel of its policy and runs the one the batch's load names.

Run with ``CUTE_DSL_ARCH=sm_90a`` (the Bazel target sets it).
"""

import atexit
import dataclasses
import os
import re
import shutil
import subprocess
import sys
import tempfile

import pytest

_DUMP = tempfile.mkdtemp(prefix="kda_cutedsl_dump_")
atexit.register(shutil.rmtree, _DUMP, True)
os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
os.environ.setdefault("CUTE_DSL_KEEP", "ptx,cubin")
os.environ.setdefault("CUTE_DSL_DUMP_DIR", _DUMP)

cutlass = pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl not installed")

import torch  # noqa: E402

from kda.backends.cutedsl import args, cache, policy, tables  # noqa: E402
from kda.backends.cutedsl import schedule as S  # noqa: E402
from kda.backends.cutedsl.problem import Problem  # noqa: E402
from kda.backends.cutedsl.static import SmemPlan  # noqa: E402
from kda.config import KdaConfig  # noqa: E402
from tools.schedules import BUILD, build  # noqa: E402

bf16, f32 = torch.bfloat16, torch.float32

#: A covering set: every axis value appears, mixed with different T and H.
CONFIGS = [
    KdaConfig(num_heads=32, T=1, window=3),
    KdaConfig(num_heads=4, T=2, window=4, conv_layout="DS", lower_bound=-5.0, gate_mode=1,
              has_conv_bias=True, conv_weight_dtype=bf16, norm_weight_dtype=bf16),
    KdaConfig(num_heads=12, T=5, window=7, gate_mode=1, record=True, conv_state_dtype=f32),
    KdaConfig(num_heads=1, T=8, window=10, conv_layout="DS", has_conv_bias=True, record=True,
              norm_weight_dtype=bf16),
    KdaConfig(num_heads=96, T=8, window=12, lower_bound=-2.5, conv_state_dtype=f32,
              conv_weight_dtype=bf16),
    KdaConfig(num_heads=8, T=5, window=11, conv_layout="DS", lower_bound=-1.0, record=True,
              conv_state_dtype=f32),
    KdaConfig(num_heads=16, T=1, window=6, conv_layout="DS", lower_bound=-5.0, gate_mode=1,
              has_conv_bias=True, record=True, conv_state_dtype=f32),
    KdaConfig(num_heads=24, T=2, window=4, has_conv_bias=True, gate_mode=1),
    KdaConfig(num_heads=96, T=3, window=5, conv_weight_dtype=bf16),
    KdaConfig(num_heads=6, T=7, window=9, conv_layout="DS", lower_bound=-3.0, gate_mode=1,
              norm_weight_dtype=bf16),
]


#: The split kernel's cases, (label, index into CONFIGS): C = 2, 4, 8 each meet T = 1 and T > 1
#: with and without record mode (together every axis).
SPLIT_CASES = [
    ("split8", 0), ("split8", 3), ("split8", 4), ("split8", 9),
    ("split4", 0), ("split4", 1), ("split4", 2), ("split4", 6), ("split4", 8),
    ("split2", 0), ("split2", 5), ("split2", 7),
]
#: The streamed kernel's cases: T = 1, 2, 5, 8, both layouts, both gates, gate_mode 0/1,
#: bias, record mode, fp32 conv state, bf16 weights; in blocks of 4 requests at T = 1-3 (and
#: with the tail of half blocks: 4 at T = 1, 2 at T > 1); with the groups preparing their items
#: (streamg) at T = 1 in both layouts, record mode; with the gate in batches of 8 items
#: (``+gb``, T = 1).
STREAM_CASES = [("stream", 0), ("stream", 1), ("stream", 2), ("stream", 4), ("stream", 7),
                ("stream4", 0), ("stream4", 6), ("stream4", 7), ("stream4", 8),
                ("streamg", 0), ("streamg", 6), ("stream4t", 0), ("stream2t", 7),
                ("stream+gb", 0), ("streamg+gb", 0), ("stream4+gb", 0), ("stream8+gb", 0)]
CASES = [("wide", i) for i in range(len(CONFIGS))] + SPLIT_CASES + STREAM_CASES
D = 128


#: Streamed builds allowed a stack (bytes), ptxas at the 168-register cap: ``streamg`` on fp32
#: pages (SD, no record) keeps the group's next operands, conv weights and norm weight across
#: the passes beside the 64 state values (bf16 pages: 153 registers, no stack), with the gate
#: in batches (``+gb``) or not. Its step times were measured with it. Strict: a case that stops
#: spilling must leave this table.
STREAM_STACK = {("streamg", 0): 40, ("streamg+gb", 0): 40}


def _case_params():
    return [pytest.param(kind, i, id=f"{kind}-{CONFIGS[i].short()}") for kind, i in CASES]


def _check_state_stores(ptx, cfg, stores):
    """``stores`` state stores in the PTX: 16-byte vectors, or (bf16 pages) 8-byte ones of
    values rounded by cvt.rn.bf16x2 (nearest even)."""
    if cfg.state_dtype == bf16:
        assert "st.global.v4" not in ptx
        assert ptx.count("st.global.v2.b32") == stores
        assert ptx.count("cvt.rn.bf16x2.f32") == 2 * stores
    else:
        assert ptx.count("st.global.v4") == stores


def _check_stream_ptx(ptx, cfg, early=False):
    """The streamed kernel (``early``: built with ``early_reads``): the gate on the tensor
    cores (each prep warp 2 tiles of 16 features x 8 k-steps), the state moved as 32-row
    units by bulk copies on mbarriers (the first items of each warp, then one refill per
    unit), a proxy fence before a stage is refilled, state stores per 4-column chunk, pass
    of 16 rows and token (on bf16 pages at T > 1 the passes and tokens are loops: one copy of
    a token's stores)."""
    assert len(re.findall(MMA, ptx)) == 2 * 8
    unit = 32 * D * (2 if cfg.state_dtype == bf16 else 4)
    copies = _bulk_copies(ptx)
    state = [at for at, n in copies if n == unit]
    # T <= 6: the head's f_b rows staged in shared memory, one 256-byte row per prep thread
    fb = [n for _, n in copies if n != unit]
    assert state and fb == ([2 * D] * len(fb)) and bool(fb) == (cfg.T <= 6), copies
    assert "fence.proxy.async.shared::cta" in ptx
    # each role waits for the predecessor (the prep warps after staging f_b, a weight)
    assert ptx.count("griddepcontrol.wait") == 2
    assert ptx.count("griddepcontrol.launch_dependents") == 1
    i_wait = ptx.index("griddepcontrol.wait")
    if early:
        # the walk's first pages go before its wait, and nothing is written before it
        assert state[0] < i_wait < ptx.index("st.global"), "early reads: pages before the wait"
    else:
        assert i_wait < state[0], "the pages are requested before griddepcontrol.wait"
    # state stores: chunks x register rows x passes x tokens
    looped = cfg.state_dtype == bf16 and cfg.T > 1
    _check_state_stores(ptx, cfg, 0 if cfg.record else 4 * 4 * (1 if looped else 2 * cfg.T))


def test_cases_cover_every_axis():
    """The covering sets keep covering: every axis value is compiled by the wide kernel and
    by the split kernel, and every cluster size by the latter."""
    def axes(cfg):
        return {("T", cfg.T), ("layout", cfg.conv_layout), ("bounded", cfg.lower_bound is not None),
                ("gate_mode", cfg.gate_mode), ("bias", cfg.has_conv_bias), ("record", cfg.record),
                ("cs", cfg.conv_state_dtype), ("cw", cfg.conv_weight_dtype),
                ("nw", cfg.norm_weight_dtype)}

    every = set().union(*(axes(c) for c in CONFIGS))
    assert {v for k, v in every if k == "T"} == {1, 2, 3, 5, 7, 8}
    split = set().union(*(axes(CONFIGS[i]) for _, i in SPLIT_CASES))
    assert {a for a in every if a[0] != "T"} <= split
    assert {v for k, v in split if k == "T"} >= {1, 2, 5, 8}
    for C in (2, 4, 8):
        mine = [CONFIGS[i] for kind, i in SPLIT_CASES if kind == f"split{C}"]
        assert {(c.T == 1, c.record) for c in mine} >= {(True, False), (False, False)}, C
        assert any(c.record for c in mine), C
    assert {kind for kind, _ in SPLIT_CASES} == {"split2", "split4", "split8"}


def _cuobjdump():
    exe = shutil.which("cuobjdump")
    if exe:
        return exe
    cands = [os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "cuobjdump")]
    for p in sys.path:
        cands.append(os.path.join(p, "nvidia", "cu13", "bin", "cuobjdump"))
        cands.append(os.path.join(p, "triton", "backends", "nvidia", "bin", "cuobjdump"))
    for cand in cands:
        if os.path.isfile(cand) and os.access(cand, os.X_OK):
            return cand
    return None


def _resource_usage(cubin: bytes):
    """{'REG': n, 'STACK': n, ...} of the (single) kernel in ``cubin``, or None."""
    exe = _cuobjdump()
    if exe is None or not cubin:
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        try:
            out = subprocess.run([exe, "--dump-resource-usage", f.name], capture_output=True,
                                 text=True, timeout=60).stdout
        except (OSError, subprocess.SubprocessError):
            return None
    m = re.findall(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", out)
    if len(m) != 1:
        return None
    return dict(zip(("REG", "STACK", "SHARED", "LOCAL"), map(int, m[0])))


_compiled = {}


def _compile(kind, i):
    """(PTX, cubin) of ``kind`` built as the backend builds it for CONFIGS[i] (compiled once
    per process)."""
    if (kind, i) not in _compiled:
        pb, sched = build(kind, CONFIGS[i])
        compiled, secs = cache.compile_kernel(pb, sched)
        assert compiled is not None
        print(f"{sched.tag()} {pb.tag()}: compiled in {secs:.2f} s")
        _compiled[kind, i] = (compiled.__ptx__, compiled.__cubin__)
    return _compiled[kind, i]


MMA = r"mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.bf16\.bf16\.f32"


def _bulk_copies(ptx):
    """[(offset in the PTX, bytes)] of every global -> shared bulk copy (bytes None when the
    size is not a constant)."""
    out = []
    for m in re.finditer(r"cp\.async\.bulk\.shared::cluster\.global\S*\s+\[[^\]]*\],\s*"
                         r"\[[^\]]*\],\s*([^,\s]+),", ptx):
        op = m.group(1)
        if op.isdigit():
            n = int(op)
        else:
            defs = set(re.findall(rf"mov\.[bu]32\s+{re.escape(op)},\s*(\d+);", ptx))
            n = int(defs.pop()) if len(defs) == 1 else None
        out.append((m.start(), n))
    return out


def _check_wide_ptx(ptx, cfg, rows=16):
    # gate projection on the tensor cores: 8 k-steps of m16n8k16 (one or four chains)
    assert len(re.findall(MMA, ptx)) == 8
    # 16-byte staging copies through L2 for the state page and the token rows
    assert "cp.async.cg.shared.global" in ptx and ", 16;" in ptx
    # a dead item's output rows: one 16-byte store of zeros per thread on 16-byte rows
    zeros = 1 if rows == 16 else 0
    pages = 0 if cfg.record else cfg.T
    if cfg.state_dtype == bf16:
        # (aligned rows) the bf16 page: 16 copies of 8 bytes; each state written: 16 stores
        # of 8 bytes, four values rounded to nearest even by two cvt.rn.bf16x2
        # (CuTe's cp.async atom names the source size too: ", 8, 8;")
        ca8 = r"cp\.async\.ca\.shared\.global \[[^\]]*\], \[[^\]]*\], 8(?:, 8)?;"
        assert len(re.findall(ca8, ptx)) == 16
        assert ptx.count("st.global.v2.b32") == 16 * pages
        assert ptx.count("cvt.rn.bf16x2.f32") == 32 * pages
        assert ptx.count("st.global.v4") == zeros, "no fp32 state stores into a bf16 pool"
    else:
        # each state written (none in record mode): 16 stores of 16 bytes
        assert ptx.count("st.global.v4") == 16 * pages + zeros, "state stores: 16-byte vectors"
    # programmatic dependent launch: the wait first, the trigger after a GPU-scope fence at the end
    assert ptx.count("griddepcontrol.wait") == 1
    assert ptx.count("griddepcontrol.launch_dependents") == 1
    i_wait, i_trig = ptx.index("griddepcontrol.wait"), ptx.index("griddepcontrol.launch_dependents")
    assert i_wait < ptx.index("fence.acq_rel.gpu") < i_trig


def _check_split_ptx(ptx, cfg, C):
    rows = D // C                 # value rows and gate features of one CTA
    # the CTA's share of the gate projection: 8 k-steps for each 16 of its features
    assert len(re.findall(MMA, ptx)) == 8 * rows // 16
    # one bulk copy of the CTA's state rows (rows x 512 B), after the PDL wait (the slots
    # and pages may be the predecessor's output); the weights before the wait: the f_b rows
    # (256 B each), one copy per 32 rows (one per lane), and the CTA's dt_bias (4 B a feature)
    copies = _bulk_copies(ptx)
    block = rows * D * (2 if cfg.state_dtype == bf16 else 4)
    state = [at for at, n in copies if n == block]
    assert len(state) == 1, f"state-row bulk copies: {copies}"
    weights = sorted(n for _, n in copies if n != block)
    assert weights == sorted([2 * D] * (-(-rows // 32)) + [4 * rows]), copies
    assert ptx.count("griddepcontrol.wait") == 1
    i_wait = ptx.index("griddepcontrol.wait")
    assert all(at < i_wait for at, n in copies if n != block), copies
    # decays and o exchanged through (distributed) shared memory, completion on mbarriers
    assert "st.async.shared::cluster.mbarrier::complete_tx::bytes" in ptx
    assert ptx.count("griddepcontrol.launch_dependents") == 1
    assert i_wait < ptx.index("griddepcontrol.launch_dependents")
    assert i_wait < state[0], "the state rows are requested before griddepcontrol.wait"
    # state stores: one per 4-column chunk (4 per row), pass of 16 rows and token (T = 1: once,
    # after the token)
    _check_state_stores(ptx, cfg, 0 if cfg.record else 4 * (rows // 16) * cfg.T)


@pytest.mark.parametrize("kind,i", _case_params())
def test_compiles(kind, i):
    cfg = CONFIGS[i]
    ptx, _ = _compile(kind, i)
    if not isinstance(ptx, str) or ".entry" not in ptx:
        pytest.skip("PTX not kept (CuTe DSL was imported before CUTE_DSL_KEEP was set)")
    _check_ptx(ptx, cfg, build(kind, cfg)[1])
    assert "ld.local" not in ptx and "st.local" not in ptx, "local arrays left in the PTX"


def _check_ptx(ptx, cfg, sched, early=False):
    """The checks of the kernel ``sched`` runs on."""
    if sched.rows == S.Rows.CTA:
        _check_wide_ptx(ptx, cfg)
    elif sched.rows == S.Rows.WARP:
        _check_stream_ptx(ptx, cfg, early)
    else:
        _check_split_ptx(ptx, cfg, sched.cluster)


#: The cluster sizes the policy runs, by default or by a shipped table (the others are built
#: for the bit-identity checks only).
POLICY_CLUSTERS = {axes["cluster"] for rows in policy.DEFAULT.values() for by_t in rows.values()
                   for _, axes in by_t if "cluster" in axes} | {
    r.schedule["cluster"] for name in tables.shipped() for r in tables.for_device(name).rows
    if "cluster" in r.schedule}


@pytest.mark.parametrize("kind,i", _case_params())
def test_resource_usage(kind, i):
    """Registers and stack from the cubin: the wide kernel fits 2 CTAs of 256 threads per SM
    with a bounded stack; the streamed kernels and the split kernels ``cutedsl`` runs do not
    spill (but :data:`STREAM_STACK`; split2, kept for the bit-identity checks, may spill a
    few words)."""
    _, cubin = _compile(kind, i)
    if _cuobjdump() is None:
        pytest.skip("cuobjdump not found (PATH, CUDA_HOME, nvidia / triton wheels)")
    usage = _resource_usage(cubin)
    assert usage is not None, "no resource usage from cuobjdump (no cubin kept?)"
    print(f"{kind} {CONFIGS[i].short()}: {usage}")
    if kind == "wide":
        assert usage["REG"] <= 128, "must fit 2 CTAs of 256 threads per SM"
        assert usage["STACK"] <= 512, "register spills grew out of bounds"
    elif kind.startswith("stream"):
        # 384 threads (3 warpgroups): 168 registers at most, no stack but STREAM_STACK's
        assert usage["REG"] <= 168 and usage["LOCAL"] == 0, usage
        assert usage["STACK"] == STREAM_STACK.get((kind, i), 0), usage
    elif build(kind, CONFIGS[i])[1].cluster in POLICY_CLUSTERS:
        assert usage["STACK"] == 0 and usage["LOCAL"] == 0, f"spills / stack: {usage}"
    else:
        assert usage["STACK"] <= 64 and usage["LOCAL"] == 0, f"spills / stack: {usage}"


def _compile_build(pb, sched):
    """(compiled kernel, PTX) of ``pb`` with ``sched``, which must keep no local arrays; skips
    when the PTX was not kept."""
    compiled, secs = cache.compile_kernel(pb, sched)
    ptx = compiled.__ptx__
    print(f"{sched.tag()} {pb.tag()}: compiled in {secs:.2f} s")
    if not isinstance(ptx, str) or ".entry" not in ptx:
        pytest.skip("PTX not kept (CuTe DSL was imported before CUTE_DSL_KEEP was set)")
    assert "ld.local" not in ptx and "st.local" not in ptx
    return compiled, ptx


#: The engine-facing builds: (kind, config, row alignment in bytes).
FORM_CASES = [
    ("wide", KdaConfig(num_heads=4, T=1, window=3, beta_activated=True), 8),
    ("wide", KdaConfig(num_heads=2, T=2, window=4, conv_layout="DS", gate_mode=1), 4),
    ("wide", KdaConfig(num_heads=3, T=8, window=10, record=True, beta_activated=True), 2),
    ("wide", KdaConfig(num_heads=4, T=5, window=7, lower_bound=-5.0, beta_activated=True), 16),
    ("split8", KdaConfig(num_heads=3, T=1, window=3, beta_activated=True), 2),
    ("split4", KdaConfig(num_heads=2, T=2, window=4, conv_layout="DS"), 4),
]


def _ldst(ptx, pattern):
    return len(re.findall(pattern, ptx))


@pytest.mark.parametrize("kind,cfg,rows", FORM_CASES,
                         ids=[f"{k}-{c.short()}-rows{r}" for k, c, r in FORM_CASES])
def test_engine_forms_compile(kind, cfg, rows):
    """The builds for rows that are not 16-byte aligned and for an activated fp32 beta compile,
    fit, and read their operands with accesses their alignment allows: the wide kernel stages
    the x / output-gate rows with 8- or 4-byte copies or 16-bit loads (no 16-byte copy but the
    page's and the window's), loads f_a in 16-bit halves on 2-byte rows, writes a dead item's
    zeros element by element; an fp32 beta is one 32-bit load. The split kernel reads every
    row element by element whatever the alignment: its code is the aligned build's."""
    compiled, ptx = _compile_build(*build(kind, cfg, rows))
    usage = _resource_usage(compiled.__cubin__)
    if kind == "wide":
        _check_wide_ptx(ptx, cfg, rows)
        per = 128 // (2 if rows == 4 else 4)       # pieces per 128-element row
        pieces = -(-3 * cfg.T * per // 256) + -(-cfg.T * per // 256)   # x, output-gate copies
        ca = r"cp\.async\.ca\.shared\.global \[[^\]]*\], \[[^\]]*\], %d(?:, \d+)?;"
        assert _ldst(ptx, ca % 8) == (pieces if rows == 8 else 0)
        assert _ldst(ptx, ca % 4) == (pieces if rows == 4 else 0)
        # 16-byte copies: the page (one asm of 16 copies) and, SD, the window
        cg = _ldst(ptx, r"cp\.async\.cg\.shared\.global")
        assert cg == (16 if cfg.conv_layout == "DS" else 17) + (2 if rows == 16 else 0), cg
        zeros = _ldst(ptx, r"st\.global\.v4\.b32\s+\[[^\]]*\], \{0, 0, 0, 0\}")
        assert zeros == (1 if rows == 16 else 0)
        if rows == 2:       # f_a: 8 k-steps x 2 words x 2 halves; each x / og piece: 2 x 2
            assert _ldst(ptx, r"ld\.global(?:\.nc)?\.b16") == 32 + 4 * pieces
        if usage is not None:
            assert usage["REG"] <= 128 and usage["STACK"] <= 512, usage
    else:
        pb, sched = build(kind, cfg)
        _check_split_ptx(ptx, cfg, sched.cluster)
        aligned, _ = cache.compile_kernel(pb, sched)

        def code(text):       # the PTX without its kernel names and parameter alignments
            text = re.sub(r"kernel_cutlass_kernel_\w+", "K", text)
            return re.sub(r"\.align \d+ ", "", text)
        assert code(ptx) == code(aligned.__ptx__), "the split kernel's code depends on rows"
        if usage is not None:
            assert usage["STACK"] == 0 and usage["LOCAL"] == 0, usage
    beta_loads = _ldst(ptx, r"ld\.global(\.nc)?\.(b32|f32) ") - _ldst(
        cache.compile_kernel(*build(kind, dataclasses.replace(cfg, beta_activated=False),
                                     rows))[0].__ptx__, r"ld\.global(\.nc)?\.(b32|f32) ")
    assert beta_loads == (1 if cfg.beta_activated else 0)


#: The bf16-state builds: (kind, config). Every kernel kind, T = 1 and T > 1, record mode.
BF16_STATE_CASES = [
    ("wide", KdaConfig(num_heads=32, T=1, window=3, state_dtype=bf16)),
    ("wide", KdaConfig(num_heads=4, T=5, window=7, conv_layout="DS", lower_bound=-5.0,
                       state_dtype=bf16)),
    ("wide", KdaConfig(num_heads=12, T=2, window=4, record=True, state_dtype=bf16)),
    ("split8", KdaConfig(num_heads=12, T=1, window=3, state_dtype=bf16)),
    ("split8", KdaConfig(num_heads=12, T=4, window=6, gate_mode=1, state_dtype=bf16)),
    ("split4", KdaConfig(num_heads=32, T=1, window=3, has_conv_bias=True, state_dtype=bf16)),
    ("split4", KdaConfig(num_heads=4, T=5, window=7, record=True, state_dtype=bf16)),
    ("stream", KdaConfig(num_heads=32, T=1, window=3, state_dtype=bf16)),
    ("stream4", KdaConfig(num_heads=32, T=1, window=3, state_dtype=bf16)),
    ("streamg", KdaConfig(num_heads=12, T=1, window=4, has_conv_bias=True, state_dtype=bf16)),
    ("streamg+gb", KdaConfig(num_heads=12, T=1, window=4, has_conv_bias=True,
                             state_dtype=bf16)),
    ("stream8+gb", KdaConfig(num_heads=32, T=1, window=3, state_dtype=bf16)),
    ("stream", KdaConfig(num_heads=12, T=4, window=6, gate_mode=1, state_dtype=bf16)),
    ("stream", KdaConfig(num_heads=8, T=3, window=5, record=True, state_dtype=bf16)),
    ("stream", KdaConfig(num_heads=32, T=2, window=4, state_dtype=bf16)),
    ("stream", KdaConfig(num_heads=32, T=8, window=10, state_dtype=bf16)),
    ("stream", KdaConfig(num_heads=12, T=6, window=9, conv_layout="DS", record=True,
                         state_dtype=bf16)),
    ("split2", KdaConfig(num_heads=2, T=2, window=4, state_dtype=bf16)),
]


@pytest.mark.parametrize("kind,cfg", BF16_STATE_CASES,
                         ids=[f"{k}-{c.short()}" for k, c in BF16_STATE_CASES])
def test_bf16_state_builds_compile(kind, cfg):
    """The bf16-state builds compile and fit, move the page with the accesses the design
    names (wide: 8-byte cp.async of each 4-column chunk; split: one bulk copy of the CTA's
    rows at half the bytes) and round every state written to nearest even, with 8-byte
    stores; fp32 pools' builds are untouched (their checks above)."""
    pb, sched = build(kind, cfg)
    assert pb.state_bf16 and "st16" in pb.tag()
    compiled, ptx = _compile_build(pb, sched)
    _check_ptx(ptx, cfg, sched)
    usage = _resource_usage(compiled.__cubin__)
    if usage is not None:
        if sched.rows == S.Rows.CTA:
            assert usage["REG"] <= 128 and usage["STACK"] <= 512, usage
        elif sched.rows == S.Rows.WARP:
            assert usage["REG"] <= 168 and usage["STACK"] == 0, usage
        elif sched.cluster in POLICY_CLUSTERS:
            assert usage["STACK"] == 0 and usage["LOCAL"] == 0, usage


#: The gate in batches on f_a rows of every alignment (8 and 4 bytes: 16 and 32 chunks a row by
#: cp.async; 2: element copies) and with the tail of half blocks: (label, config, rows, fields).
GATE_BATCH_FORMS = [
    ("stream4", KdaConfig(num_heads=12, T=1, window=3, lower_bound=-5.0), 8, {}),
    ("stream", KdaConfig(num_heads=5, T=1, window=3, beta_activated=True), 4, {}),
    ("streamg", KdaConfig(num_heads=4, T=1, window=3, conv_layout="DS"), 2, {}),
    ("stream8t", KdaConfig(num_heads=32, T=1, window=3, state_dtype=bf16), 16, {}),
]


@pytest.mark.parametrize("kind,cfg,rows,fields", GATE_BATCH_FORMS,
                         ids=[f"{k}+gb-{c.short()}-rows{r}" for k, c, r, _ in GATE_BATCH_FORMS])
def test_gate_batch_forms_compile(kind, cfg, rows, fields):
    """``gate_batch`` builds on unaligned f_a rows and in blocks with the tail compile
    without local arrays and with no more stack than the same build without it, their batch's
    rows copied with the alignment's widest cp.async (none on 2-byte rows), one MMA pass of
    2 tiles x 8 k-steps per prep warp."""
    pb, sched = build(kind, cfg, rows, gate_batch=True, **fields)
    assert sched.gate_batch
    compiled, ptx = _compile_build(pb, sched)
    assert len(re.findall(MMA, ptx)) == 2 * 8
    fa = r"cp\.async\.c[ag]\.shared\.global \[[^\]]*\], \[[^\]]*\], %d[,;]"
    if rows > 2:
        assert _ldst(ptx, fa % rows) >= 1
    else:
        assert _ldst(ptx, fa % 16) + _ldst(ptx, fa % 8) + _ldst(ptx, fa % 4) == 0
    usage = _resource_usage(compiled.__cubin__)
    if usage is not None:
        plain = _resource_usage(_compile_build(*build(kind, cfg, rows, **fields))[0].__cubin__)
        assert usage["REG"] <= 168 and usage["LOCAL"] == 0, usage
        assert usage["STACK"] <= plain["STACK"], (usage, plain)


#: The cluster kernel with its rows loaded straight into registers (``state_direct``): C = 4 and
#: 8, T = 1 and 4, both state dtypes, record mode.
DIRECT_CASES = [
    ("split4+direct", KdaConfig(num_heads=12, T=1, window=3, lower_bound=-5.0)),
    ("split4+direct", KdaConfig(num_heads=12, T=4, window=6, state_dtype=bf16)),
    ("split8+direct", KdaConfig(num_heads=32, T=1, window=3, state_dtype=bf16, record=True)),
    ("split8+direct", KdaConfig(num_heads=96, T=4, window=6, has_conv_bias=True)),
]


@pytest.mark.parametrize("kind,cfg", DIRECT_CASES,
                         ids=[f"{k}-{c.short()}" for k, c in DIRECT_CASES])
def test_state_direct_builds_compile(kind, cfg):
    """``state_direct``: no bulk copy of the state rows (the f_b rows' and dt_bias' copies
    stay), one 16-byte (fp32) or 8-byte (bf16) global load per chunk of the CTA's rows, the
    same state stores and exchange as the staged build; no local arrays, a stack of at most 16
    bytes (ptxas, with the rows live across the conv and norms)."""
    pb, sched = build(kind, cfg)
    assert sched.state_direct
    compiled, ptx = _compile_build(pb, sched)
    rows = D // sched.cluster
    copies = _bulk_copies(ptx)
    assert all(n != rows * D * (2 if cfg.state_dtype == bf16 else 4) for _, n in copies), copies
    loads = _ldst(ptx, r"ld\.global[.a-z:0-9]*\.v4\.(b32|f32|u32) ") if cfg.state_dtype != bf16 \
        else _ldst(ptx, r"ld\.global[.a-z:0-9]*\.(v2\.b32|v4\.b16|v4\.u16|b64|u64) ")
    assert loads >= 4 * (rows // 16), loads
    assert "st.async.shared::cluster.mbarrier::complete_tx::bytes" in ptx
    usage = _resource_usage(compiled.__cubin__)
    if usage is not None:
        assert usage["REG"] <= 128 and usage["LOCAL"] == 0 and usage["STACK"] <= 16, usage


#: The cluster kernel with the q / k channels shared out over the cluster (``split_qk``):
#: C = 2, 4, 8, T = 1, 2, 4, 5, 8, both state dtypes and layouts, record mode, bias, the rows
#: in registers.
QK_CASES = [
    ("split2+qk", KdaConfig(num_heads=12, T=1, window=3)),
    ("split4+qk", KdaConfig(num_heads=4, T=2, window=4, conv_layout="DS", lower_bound=-5.0,
                            gate_mode=1, has_conv_bias=True, record=True)),
    ("split8+qk", KdaConfig(num_heads=96, T=4, window=6, state_dtype=bf16)),
    ("split8+qk", KdaConfig(num_heads=8, T=8, window=10, conv_layout="DS", record=True,
                            conv_state_dtype=f32, norm_weight_dtype=bf16)),
    ("split2+qk", KdaConfig(num_heads=12, T=5, window=7, has_conv_bias=True, record=True,
                            state_dtype=bf16)),
    ("split8+direct+qk", KdaConfig(num_heads=32, T=1, window=3, state_dtype=bf16)),
    ("split4+direct+qk", KdaConfig(num_heads=12, T=4, window=6, lower_bound=-5.0)),
]


@pytest.mark.parametrize("kind,cfg", QK_CASES, ids=[f"{k}-{c.short()}" for k, c in QK_CASES])
def test_split_qk_builds_compile(kind, cfg):
    """``split_qk``: against the same build without it, one more mbarrier (the exchange's) and
    2 * T * C more st.async (each token's output of a q / k channel and its warp's sum of
    squares, to each of the C CTAs); no local arrays, no stack, at most 128 registers."""
    pb, sched = build(kind, cfg)
    assert sched.split_qk and sched.name == kind
    compiled, ptx = _compile_build(pb, sched)
    plain = _compile_build(pb, dataclasses.replace(sched, split_qk=False))[1]
    st_async = r"st\.async\.shared::cluster\.mbarrier::complete_tx::bytes"
    assert _ldst(ptx, st_async) - _ldst(plain, st_async) == 2 * cfg.T * sched.cluster
    assert _ldst(ptx, r"mbarrier\.init") - _ldst(plain, r"mbarrier\.init") == 1
    usage = _resource_usage(compiled.__cubin__)
    if usage is not None:
        assert usage["REG"] <= 128 and usage["LOCAL"] == 0 and usage["STACK"] == 0, usage


#: Builds with ``early_reads`` (the persistent walk on fp32 pages): T = 1, 2, 4, 8, record
#: mode, both layouts, both gates.
EARLY_CASES = [
    ("stream+early", KdaConfig(num_heads=12, T=1, lower_bound=-5.0, has_conv_bias=True,
                               early_reads=True)),
    ("stream+early", KdaConfig(num_heads=16, T=2, conv_layout="DS", record=True, gate_mode=1,
                               early_reads=True)),
    ("stream+early", KdaConfig(num_heads=32, T=4, conv_state_dtype=f32, early_reads=True)),
    ("stream+early", KdaConfig(num_heads=8, T=8, window=11, early_reads=True)),
]


@pytest.mark.parametrize("kind,cfg", EARLY_CASES, ids=[f"{k}-{c.short()}" for k, c in EARLY_CASES])
def test_early_reads_builds_compile(kind, cfg):
    """With ``early_reads`` the streamed builds issue their first pages before
    ``griddepcontrol.wait`` and write nothing before it, with the default builds' other
    accesses and resources."""
    pb = Problem.from_config(cfg)
    sched = BUILD[kind](pb)
    assert sched.early_reads and "-er" in sched.tag()
    compiled, ptx = _compile_build(pb, sched)
    _check_stream_ptx(ptx, cfg, early=True)
    usage = _resource_usage(compiled.__cubin__)
    if usage is not None:
        assert usage["REG"] <= 168 and usage["STACK"] == 0 and usage["LOCAL"] == 0, usage


def test_early_reads_only_where_a_kernel_has_them():
    """``KdaConfig.early_reads`` reaches the schedules of the persistent walk on fp32 pages
    only (where it measured faster, :func:`policy.reads_early`): every other schedule the
    policy picks, and the walk on bf16 pages, stay as without it; a schedule of another
    kernel, or of the groups' prep, cannot read early."""
    for T in (1, 4):
        for sd in (f32, bf16):
            cfg = KdaConfig(num_heads=8, T=T, state_dtype=sd, early_reads=True)
            pb = Problem.from_config(cfg)
            plain = policy.schedules(pb, 132)
            early = policy.schedules(pb, 132, early_reads=True)
            assert len(plain) == len(early)
            for a, b in zip(plain, early):
                reads = a.axes() == policy.STREAM and sd == f32
                assert b == (dataclasses.replace(a, early_reads=True) if reads else a), (a, T, sd)
    pb = Problem.from_config(KdaConfig(num_heads=8, T=1))
    for make in (S.wide, lambda pb, **kw: S.split(pb, 4, **kw),
                 lambda pb, **kw: S.stream(pb, prep=S.Prep.GROUP, **kw)):
        with pytest.raises(ValueError, match="early_reads"):
            make(pb, early_reads=True)


def test_launcher_runs_the_build_of_its_rows(monkeypatch):
    """A call on rows that are not 16-byte aligned runs the build for their alignment
    (:func:`kda.backend.row_bytes`), made on first need and kept; aligned rows run the
    launcher's own build."""
    import ctypes

    from kda.backend import row_bytes
    from kda.backends.cutedsl import backend as be
    from kda.testing import CaseSpec, make_case, make_config

    ran, made = [], []

    class FakeExe:
        def __init__(self, rows):
            self.rows = rows
            self.cuda_result = ctypes.c_int32(0)

        def _get_invoke_packed_args(self, addrs):
            return list(addrs) + [ctypes.addressof(self.cuda_result)]

        def capi_func(self, packed):
            ran.append(self.rows)

    class FakeCompiled:
        def __init__(self, rows):
            self.rows = rows

        def to(self, device):
            return FakeExe(self.rows)

    def get_kernel(pb, sched):
        made.append((pb, sched))
        return FakeCompiled(pb.row_bytes)

    monkeypatch.setattr(be, "current_stream_handle", lambda device: 0)
    monkeypatch.setattr(be, "sm_count", lambda device_index: 10)
    monkeypatch.setattr(cache, "get_kernel", get_kernel)
    cfg = make_config(4, 1)
    pb = Problem.from_config(cfg)
    wide = S.wide(pb)
    launcher = be._Launcher(wide, cfg, torch.device("cuda", 0), FakeCompiled(16), pb)
    cases = [CaseSpec(cfg, R=3), CaseSpec(cfg, R=3, packed=True),           # 16, 8 bytes
             CaseSpec(cfg, R=3, offset_rows=True), CaseSpec(cfg, R=2, packed=True),
             CaseSpec(cfg, R=1, offset_rows=True)]          # 2 bytes; one row: its address
    want = []
    for spec in cases:
        a = make_case(spec, "cpu")
        want.append(row_bytes(a))
        launcher(a)
        # the streamed kernel's grid: one CTA per SM, at most one per item
        ran_by = launcher if want[-1] == 16 else launcher.by_rows[want[-1]]
        assert ran_by.buf[ran_by.i_ctas] == min(10, spec.R * cfg.num_heads)
    assert want == [16, 8, 2, 8, 2] and ran == want
    assert [p.row_bytes for p, _ in made] == [8, 2]          # each made once
    assert all(s == wide and p == dataclasses.replace(pb, row_bytes=p.row_bytes)
               for p, s in made)
    assert set(launcher.by_rows) == {16, 8, 2}


def test_kernel_objects():
    """A schedule's rows pick its kernel class; each class refuses another kernel's schedule
    and a schedule that cannot serve the problem."""
    from kda.backends.cutedsl.split import KdaSplit
    from kda.backends.cutedsl.stream import KdaStream
    from kda.backends.cutedsl.wide import KdaWide

    pb = Problem.from_config(KdaConfig(num_heads=2, T=1, window=3))
    assert type(cache.kernel_object(pb, S.wide(pb))) is KdaWide
    for C in S.CLUSTERS:
        obj = cache.kernel_object(pb, S.split(pb, C))
        assert type(obj) is KdaSplit and obj.C == C
    for C in S.BLOCKS:
        obj = cache.kernel_object(pb, S.stream(pb, block=C))
        assert type(obj) is KdaStream and obj.block == C and not obj.group_prep
    assert cache.kernel_object(pb, S.stream(pb)).block == 0
    assert cache.kernel_object(pb, S.stream(pb, prep=S.Prep.GROUP)).group_prep
    for cls, other in ((KdaWide, S.stream(pb)), (KdaSplit, S.wide(pb)),
                       (KdaStream, S.split(pb, 2))):
        with pytest.raises(ValueError, match="expected a rows="):
            cls(pb, other)
    pb2 = Problem.from_config(KdaConfig(num_heads=2, T=2, window=4))
    group = S.stream(pb, prep=S.Prep.GROUP)
    with pytest.raises(ValueError, match="prep=GROUP serves T = 1"):
        cache.kernel_object(pb2, group)


def test_smem_fits_two_ctas_per_sm():
    for T in range(1, 9):
        plan = SmemPlan(T)
        # 228 KiB per SM, 1 KiB reserved per CTA, 2 CTAs
        assert 2 * (plan.total + 1024) <= 228 * 1024, (T, plan.total)


def test_runtime_scalars_do_not_recompile():
    a = KdaConfig(num_heads=4, T=1, window=3)
    b = KdaConfig(num_heads=4, T=1, window=3, scale=0.5, norm_eps=1e-3)
    c = KdaConfig(num_heads=4, T=1, window=3, lower_bound=-5.0)
    d = KdaConfig(num_heads=4, T=1, window=3, lower_bound=-1.0)
    assert Problem.from_config(a) == Problem.from_config(b)
    assert Problem.from_config(c) == Problem.from_config(d)
    assert Problem.from_config(a) != Problem.from_config(c)
    n0 = len(cache.COMPILE_LOG)
    with tempfile.TemporaryDirectory() as tmp:
        old = os.environ.get("KDA_CACHE_DIR")
        os.environ["KDA_CACHE_DIR"] = tmp
        try:
            pc, pd = Problem.from_config(c), Problem.from_config(d)
            k1 = cache.get_kernel(pc, S.wide(pc))
            k2 = cache.get_kernel(pd, S.wide(pd))
        finally:
            if old is None:
                del os.environ["KDA_CACHE_DIR"]
            else:
                os.environ["KDA_CACHE_DIR"] = old
    assert k1 is k2
    assert len(cache.COMPILE_LOG) == n0 + 1
    assert cache.COMPILE_LOG[-1].source == "compile" and cache.COMPILE_LOG[-1].seconds > 0


@pytest.mark.parametrize("kind", ["wide", "split8"])
def test_disk_cache_round_trip(kind):
    pb, sched = build(kind, KdaConfig(num_heads=2, T=2, window=4))
    with tempfile.TemporaryDirectory() as tmp:
        old = os.environ.get("KDA_CACHE_DIR")
        os.environ["KDA_CACHE_DIR"] = tmp
        try:
            cache.get_kernel(pb, sched)
            files = os.listdir(os.path.join(tmp, "cutedsl"))
            tag = sched.tag().replace("-", "_")
            assert len(files) == 1 and files[0].endswith(".o") and f"_{tag}_" in files[0], files
            cache._mem.clear()
            loaded = cache.get_kernel(pb, sched)
        finally:
            if old is None:
                del os.environ["KDA_CACHE_DIR"]
            else:
                os.environ["KDA_CACHE_DIR"] = old
    assert cache.COMPILE_LOG[-1].source == "disk" and cache.COMPILE_LOG[-1].name == sched.name
    assert list(loaded.execution_args.signature.parameters) == args.arg_names()


def test_source_hash_covers_every_package_file(monkeypatch, tmp_path):
    """The disk cache key changes with any source of the package, a new file included (a
    kernel module added later must not be served from an older cache)."""
    for name in os.listdir(cache._HERE):
        if name.endswith(".py"):
            shutil.copy(os.path.join(cache._HERE, name), tmp_path / name)
    monkeypatch.setattr(cache, "_HERE", str(tmp_path))

    def fresh_hash():
        monkeypatch.setattr(cache, "_src_hash", None)
        return cache.source_hash()

    base = fresh_hash()
    (tmp_path / "newkernel.py").write_text("X = 1\n")
    added = fresh_hash()
    (tmp_path / "newkernel.py").write_text("X = 2\n")
    edited = fresh_hash()
    assert len({base, added, edited}) == 3
    (tmp_path / "newkernel.py").unlink()
    assert fresh_hash() == base


def test_package_imports_without_dsl_or_gpu():
    """The backend package and its availability checks never raise."""
    import kda.backends.cutedsl as pkg

    names = sorted(b.name for b in pkg.BACKENDS)
    assert names == ["cutedsl", "cutedsl_wide"]
    for b in pkg.BACKENDS:
        why = b.availability()
        assert why is None or isinstance(why, str)
        assert b.unsupported(KdaConfig(num_heads=4, T=9, window=11), torch.device("cuda"))
        assert not [r for r in b.unsupported(KdaConfig(num_heads=4, T=8, window=10),
                                             torch.device("cuda")) if "T=" in r]


@pytest.mark.parametrize("kind", ["wide", "split2", "stream", "stream4"])
def test_launcher_packs_arguments(kind, monkeypatch):
    """The host fast path writes every argument where the compiled launcher reads it."""
    import ctypes
    import struct

    from kda.backends.cutedsl import backend as be
    from kda.testing import CaseSpec, make_case

    seen = {}

    class FakeExe:
        def __init__(self):
            self.cuda_result = ctypes.c_int32(0)

        def _get_invoke_packed_args(self, addrs):
            return list(addrs) + [ctypes.addressof(self.cuda_result)]

        def capi_func(self, packed):
            seen["packed"] = [packed[i] for i in range(len(packed))]

    class FakeCompiled:
        def to(self, device):
            seen["device"] = device
            return FakeExe()

    monkeypatch.setattr(be, "current_stream_handle", lambda device: 0xABCDEF)
    monkeypatch.setattr(be, "sm_count", lambda device_index: 10)
    cfg = KdaConfig(num_heads=4, T=2, window=5, conv_layout="DS", lower_bound=-2.0, scale=0.25,
                    norm_eps=1e-4, has_conv_bias=True, record=True)
    pb, sched = build(kind, cfg)
    launcher = be._Launcher(sched, cfg, torch.device("cuda", 0), FakeCompiled(), pb)
    a = make_case(CaseSpec(cfg, R=3, padded=True), "cpu")
    launcher(a)
    names = args.arg_names()
    packed = seen["packed"]
    assert len(packed) == len(names) + 1 and seen["device"] == 0

    def u64(i):
        return ctypes.c_uint64.from_address(packed[i]).value

    def i32(i):
        return ctypes.c_int32.from_address(packed[i]).value

    def f32(i):
        return struct.unpack("<f", struct.pack("<I", ctypes.c_uint32.from_address(packed[i]).value))[0]

    want_ptr = a._asdict()          # every tensor of the record, under its field's name
    idx = {n: i for i, n in enumerate(names)}
    for n, t in want_ptr.items():
        assert u64(idx[n]) == t.data_ptr(), n
    assert i32(idx["R"]) == 3 and i32(idx["slots"]) == a.state.shape[0]
    assert i32(idx["x_rs"]) == a.x.stride(0) and i32(idx["fa_rs"]) == a.f_a.stride(0)
    assert i32(idx["beta_rs"]) == a.beta.stride(0) and i32(idx["og_rs"]) == a.output_gate.stride(0)
    assert i32(idx["out_rs"]) == a.out.stride(0)
    assert u64(idx["state_ss"]) == a.state.stride(0) and u64(idx["cs_ss"]) == a.conv_state.stride(0)
    assert f32(idx["scale"]) == pytest.approx(0.25) and f32(idx["eps"]) == pytest.approx(1e-4)
    assert f32(idx["lb"]) == -2.0
    # min(SMs, R * H = 12); stream4: one CTA per 4 items
    assert i32(idx["ctas"]) == (3 if kind == "stream4" else 10)
    assert u64(idx["stream"]) == 0xABCDEF
    assert packed[-1] == ctypes.addressof(launcher._result)
    seen.clear()
    launcher(a._replace(state_indices=a.state_indices[:0]))
    assert not seen, "an empty batch launches nothing"


def test_kernel_args_follow_the_launch_order():
    """The kernels' argument record is the launcher's arguments, in its order: the record's
    tensors under their field names, then the scalars; every kernel shares the one entry."""
    from kda.backends.cutedsl.args import OPERANDS, SCALARS, KernelArgs, Launch
    from kda.config import KdaArgs
    assert list(KernelArgs._fields) == args.arg_names()[:-1] == list(KdaArgs._fields) + [
        n for n, _ in SCALARS]
    assert tuple(OPERANDS) == KdaArgs._fields
    for kind in ("wide", "split4", "stream"):
        obj = cache.kernel_object(*build(kind, KdaConfig(num_heads=4, T=1, window=3)))
        assert isinstance(obj, Launch) and callable(obj._launch), kind


def test_a_process_without_a_gpu_compiles_for_sm90a():
    """Without a GPU and without ``CUTE_DSL_ARCH``, the backend makes CuTe DSL compile for
    sm_90a: nothing imports the DSL before :func:`import_cutedsl` sets it (the package, its
    policy, tables and the launcher's modules import without it)."""
    env = {k: v for k, v in os.environ.items() if k not in ("CUTE_DSL_ARCH", "CUTE_DSL_KEEP",
                                                             "CUTE_DSL_DUMP_DIR")}
    code = ("import kda.backends.cutedsl\n"
            "from kda.backends.cutedsl import policy, tables, schedule\n"
            "from kda.backends.cutedsl.backend import import_cutedsl\n"
            "assert import_cutedsl() is None\n"
            "from kda.backends.cutedsl import cache\n"
            "print(cache.target_arch())\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split()[-1] == "sm_90a", r.stdout
