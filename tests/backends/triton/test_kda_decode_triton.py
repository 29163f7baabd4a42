"""Tests of the Triton backend beyond the cross-backend conformance suite.

* Every launch variant against the reference, and (interpreter) bit-identical to each other.
* The V-split "last arriver" counters across repeated steps, the persistent loop's tail.
* Offline sm_90a compilation (no GPU needed, Triton's bundled ptxas): register cap, no spill
  at T=1, no 64 KiB layout conversion of the state tile, 16-byte vector state accesses, the
  gate on tensor cores, the V-split atomic with acq_rel semantics.
* Host wrapper: variant selection, registry entry, CUDA-graph capture (GPU only).

On the CPU run with ``TRITON_INTERPRET=1`` (the Bazel target sets it); on a GPU run plainly:
``python3 -m pytest -q tests/backends/triton``.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")

from kda.backends.triton import kda_decode as kd  # noqa: E402
from kda.backend import current_stream_handle  # noqa: E402
from kda.config import KdaConfig  # noqa: E402
from kda.reference import reference_step  # noqa: E402
from kda.testing import CaseSpec, bits_equal, clone_args, compare_step, make_case, make_config  # noqa: E402

INTERP = kd.interpreter_enabled()
WRITTEN = ("out", "state", "conv_state", "v_record", "kg_record")
VARIANTS = ("item", "vsplit2", "vsplit4", "persistent", "item_w16", "chunked", "chunked_bv16",
            "chunked_w2_hold", "chunked_k4", "chunked_w2_k4")
# on the GPU also the other pipeline depths (the interpreter does not pipeline)
if not INTERP:
    VARIANTS += ("chunked_s3", "chunked_s4", "chunked_bv16_s3", "chunked_w2", "chunked_w2_s3",
                 "chunked_w8_bv64", "chunked_bv16_k4", "chunked_w2_s3_k4")


@pytest.fixture(scope="module")
def device():
    if INTERP:
        return torch.device("cpu")
    if torch.cuda.is_available():
        return torch.device("cuda")
    pytest.skip("no CUDA device and TRITON_INTERPRET is not set")




def _run_step(spec, device, step):
    """(args after ``step``, the reference's result, the inputs) on a fresh case."""
    args = make_case(spec, device)
    before = clone_args(args)
    expected = clone_args(args)
    reference_step(spec.cfg, expected)
    step(args)
    return args, expected, before


def _run(spec, device, variant):
    return _run_step(spec, device, kd.build_step(spec.cfg, device, variant))


# Small cases over the axes where the variants differ (row blocks, records, aliasing writes,
# dead items, padded strides, both layouts and gates, long windows).
SPECS = [
    CaseSpec(make_config(3, 1), R=3),
    CaseSpec(make_config(2, 1, "DS", lb=-5.0, gm=1, bias=True, cs32=True), R=3, padded=True),
    CaseSpec(make_config(2, 2, "SD", lb=-1.5, extra_window=2, bf16_weights=True), R=4),
    CaseSpec(make_config(1, 5, "DS", gm=1, record=True, bias=True), R=3),
    CaseSpec(make_config(1, 8, "SD", lb=-5.0), R=2, seed=3),
    CaseSpec(make_config(2, 3), R=3, null_frac=1.0),
]


@pytest.mark.parametrize("spec", SPECS, ids=[s.id for s in SPECS])
def test_variants_match_reference_and_each_other(spec, device):
    results = {}
    for variant in VARIANTS:
        args, expected, before = _run(spec, device, variant)
        errors = compare_step(args, expected, before)
        assert not errors, f"{variant}: " + "\n".join(errors)
        results[variant] = args
    if INTERP:
        # under the interpreter every variant with the same state tile shape (kb) sums in the
        # same order: identical bits (kb=4 sums a row's 4 column blocks first)
        for kb in sorted({kd.VARIANTS[v].kb for v in VARIANTS}):
            group = [v for v in VARIANTS if kd.VARIANTS[v].kb == kb]
            assert len(group) >= 2, (kb, group)
            first = results[group[0]]
            for variant in group[1:]:
                for name in WRITTEN:
                    assert bits_equal(getattr(first, name), getattr(results[variant], name)), \
                        (variant, name)


def test_vsplit_counters_survive_repeated_steps(device):
    """One step function, several batches of different sizes: the per-item counters must stay
    at a multiple of NV after each step (dead items never touch them)."""
    cfg = KdaConfig(num_heads=2, T=2, window=4)
    step = kd.build_step(cfg, device, "vsplit4")
    for i, R in enumerate((3, 5, 2)):
        errors = compare_step(*_run_step(CaseSpec(cfg, R=R, seed=40 + i), device, step))
        assert not errors, f"step {i}: " + "\n".join(errors)
        ctr = step._ctr.cpu()
        assert bool((ctr % 4 == 0).all()), ctr


def test_auto_split_counts_change_between_calls(device):
    """``auto`` picks the V-split block count per batch size, and one step object keeps one
    counter per item for every count: R = 1, 2, 1 at H=1 runs NV = 4, 2, 4 on the interpreter's
    4 "SMs" (NV = 4, 4, 2... on a GPU at other sizes). The last block resets its item's counter,
    so each launch starts from zero; without that the third launch took the second block to
    arrive for the last one (out 100% wrong; found by a review)."""
    cfg = KdaConfig(num_heads=1, T=1, window=3)
    step = kd.build_step(cfg, device, "auto")
    sms = 4 if INTERP else torch.cuda.get_device_properties(device).multi_processor_count
    sizes = [max(1, sms // 4), max(1, sms // 2), max(1, sms // 4)]
    assert [kd._auto_nv(r, sms) for r in sizes] == [4, 2, 4]
    for i, R in enumerate(sizes):
        errors = compare_step(*_run_step(CaseSpec(cfg, R=R, seed=80 + i, null_frac=0.0), device,
                                         step))
        assert not errors, f"step {i} (R={R}): " + "\n".join(errors)
        assert int(step.small._ctr.abs().sum()) == 0


def test_chunked_scratch_across_batch_sizes(device, monkeypatch):
    """Chunked step functions, batches of growing and shrinking size: the device's (and
    stream's) shared scratch grows once and is reused (no stale values leak between steps), a second step
    function (another layer) shares it, and the outgrown buffer stays alive (CUDA graphs
    captured before the growth keep valid pointers)."""
    from kda.backends.triton import kda_decode_chunked as kc
    monkeypatch.setattr(kc, "_SCRATCH", {})
    cfg = KdaConfig(num_heads=2, T=3, window=5)
    step = kd.build_step(cfg, device, "chunked")
    other = kd.build_step(KdaConfig(num_heads=4, T=1, window=3), device, "chunked")
    sizes = []
    for i, R in enumerate((2, 40, 3)):
        errors = compare_step(*_run_step(CaseSpec(cfg, R=R, seed=60 + i), device, step))
        assert not errors, f"step {i}: " + "\n".join(errors)
        sizes.append(step._scr.numel())
    assert sizes[0] < sizes[1] == sizes[2], sizes
    assert other._scr is step._scr
    dev = torch.device(device)
    assert len(kc._SCRATCH[dev].kept[current_stream_handle(dev)]) == 2


def test_persistent_tail_and_auto_split(device):
    """Persistent grid whose work count is not a multiple of the grid (tail iterations are
    masked), and the auto variant's choice of row blocks."""
    cfg = KdaConfig(num_heads=3)
    args, expected, before = _run(CaseSpec(cfg, R=3, seed=5), device, "persistent")
    assert not compare_step(args, expected, before)
    step = kd.TritonStep(cfg, device, kd.VARIANTS["auto"])
    step.num_sms = 132
    assert [step.nv_for(n) for n in (1, 33, 34, 66, 67, 4096)] == [4, 4, 2, 2, 1, 1]
    auto = kd.build_step(cfg, device, "auto")
    assert isinstance(auto, kd.AutoStep)
    auto.small.num_sms = 132
    assert [auto.kernel_for(n) for n in (1, 131, 132, 4096)] == \
        ["item", "item", "chunked_w2_s3", "chunked_w2_s3"]
    for T, names in ((2, ("chunked", "chunked_w2", "chunked_w2", "chunked_w2")),
                     (3, ("chunked_bv16", "chunked_w2", "chunked_w2", "chunked_bv16")),
                     (8, ("chunked_bv16", "chunked_w2", "chunked_w2", "chunked_bv16"))):
        auto_t = kd.build_step(KdaConfig(num_heads=1, T=T, window=T + 2), device, "auto")
        auto_t.small.num_sms = 132
        assert [auto_t.kernel_for(n) for n in (131, 132, 528, 8447, 8448)] == ["item", *names], T


def test_variant_selection(monkeypatch):
    cfg = KdaConfig(num_heads=1)
    with pytest.raises(ValueError, match="valid"):
        kd.resolve_variant("nope")
    monkeypatch.setenv(kd.VARIANT_ENV, "vsplit2")
    assert kd.resolve_variant().name == "vsplit2"
    assert kd.resolve_variant("item").name == "item"
    monkeypatch.delenv(kd.VARIANT_ENV)
    assert kd.resolve_variant().name == kd.DEFAULT_VARIANT
    assert cfg.num_heads == 1


def test_registry_entry(device):
    from kda.registry import get_backend
    b = get_backend("triton")
    assert b.availability() is None
    assert b.unsupported(KdaConfig(num_heads=4, T=8, window=10), device) == []
    assert any("T <= 8" in r for r in b.unsupported(KdaConfig(num_heads=4, T=9, window=11), device))
    other = torch.device("cuda" if device.type == "cpu" else "cpu")
    assert b.unsupported(KdaConfig(num_heads=4), other)


_OFFLINE = r"""
import json, re, sys, torch
from kda.config import KdaConfig
from kda.backends.triton.kda_decode import compile_offline, resource_usage
cases = {
    "t1": (KdaConfig(num_heads=32), "item"),
    "t1ds": (KdaConfig(num_heads=32, conv_layout="DS", gate_mode=1, has_conv_bias=True), "item"),
    "t5": (KdaConfig(num_heads=32, T=5, window=7, lower_bound=-5.0), "item"),
    "t2rec": (KdaConfig(num_heads=8, T=2, window=4, record=True,
                        conv_state_dtype=torch.float32), "item"),
    "vsplit4": (KdaConfig(num_heads=32, T=2, window=4), "vsplit4"),
    "chunked_t1": (KdaConfig(num_heads=32), "chunked"),
    "chunked_t1ds": (KdaConfig(num_heads=32, conv_layout="DS", gate_mode=1, has_conv_bias=True),
                     "chunked"),
    "chunked_t5": (KdaConfig(num_heads=32, T=5, window=7, lower_bound=-5.0), "chunked"),
    "chunked_t2rec": (KdaConfig(num_heads=8, T=2, window=4, record=True,
                                conv_state_dtype=torch.float32), "chunked"),
    "w2s3_t1": (KdaConfig(num_heads=32), "chunked_w2_s3"),
    "w2s3_t1ds": (KdaConfig(num_heads=32, conv_layout="DS", gate_mode=1, has_conv_bias=True),
                  "chunked_w2_s3"),
    "w2_t5": (KdaConfig(num_heads=32, T=5, window=7, lower_bound=-5.0), "chunked_w2"),
}
out = {}
for name, (cfg, variant) in cases.items():
    k = compile_offline(cfg, variant)
    g, ptx = k.asm["ttgir"], k.asm["ptx"]
    dots = [re.search(r"(%\S+) = tt.dot \S+, \S+, (%[\w.]+)", l).groups()
            for l in k.asm["ttir"].splitlines() if "tt.dot" in l]
    results = {d[0] for d in dots}
    out[name] = dict(resource_usage(k),
        dots=len(dots), chained_dots=sum(1 for d in dots if d[1] in results),
        big_converts=sum(1 for l in g.splitlines() if "convert_layout" in l
                         and re.search(r"tensor<(32|64|128)x128x", l)),
        state_ld_v4=len(re.findall(r"ld\.global\.L1::evict_first[.\w:]*\.v4\.b32", ptx)),
        state_st_v4=len(re.findall(r"st\.global\.cs\.v4\.b32", ptx)),
        mma=len(re.findall(r"mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.bf16\.bf16\.f32", ptx)),
        atom=len(re.findall(r"atom\.global\.gpu\.acq_rel\.add", ptx)),
        state_async=len(re.findall(r"ttg\.async_copy_global_to_local .* evictionPolicy = "
                                   r"evict_first .*tensor<32x128x!tt\.ptr<f32>", g)),
        cp_async16=len(re.findall(r"cp\.async\.cg\.shared\.global .*, 0x10", ptx)))
print("RESULT" + json.dumps(out))
"""


def test_offline_sm90a_compilation(tmp_path):
    """Compile for sm_90a without a GPU and check the resources the design relies on."""
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    # Triton's default cache ($HOME/.triton) is read-only inside Bazel's linux-sandbox
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    proc = subprocess.run([sys.executable, "-c", _OFFLINE], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = json.loads(proc.stdout.split("RESULT", 1)[1])
    for name, r in res.items():
        assert r["big_converts"] == 0, (name, r)        # the state tile keeps its layout
        assert r["mma"] >= 16, (name, r)                # the gate runs on bf16 tensor cores
    for name in ("t1", "t1ds", "t5", "t2rec"):
        r = res[name]
        assert r["regs"] <= 128, (name, r)             # two 8-warp CTAs per SM
        assert r["state_ld_v4"] == 16, (name, r)       # 64 KiB page: 16 x 16 B per thread
    for name in ("t1", "t1ds"):
        assert res[name]["stack"] == 0, (name, res[name])   # T=1: no spill under the cap
    assert res["t5"]["stack"] <= 256, res["t5"]             # T>1: a few spilled values at most
    assert res["t1"]["state_st_v4"] == 16
    assert res["t5"]["state_st_v4"] == 16                   # token loop: one page write each
    assert res["t2rec"]["state_st_v4"] == 0                 # record mode: no state write
    assert res["vsplit4"]["atom"] >= 1                      # last-arriver counter
    # chunked: <= 88 registers (5 CTAs of 4 warps per SM), no spill at T=1, the 32x128 state
    # chunk prefetched by the software pipeliner (async copies of 16 bytes into shared memory)
    for name in ("chunked_t1", "chunked_t1ds", "chunked_t5", "chunked_t2rec"):
        r = res[name]
        assert r["regs"] <= 88, (name, r)
        assert r["state_async"] >= 1, (name, r)             # prologue + loop copies
        assert r["cp_async16"] >= 8, (name, r)
    for name in ("chunked_t1", "chunked_t1ds"):
        assert res[name]["stack"] == 0, (name, res[name])
    # auto's 2-warp builds: <= 128 registers (8 programs of 2 warps per SM), bounded stack,
    # the 16x128 chunk prefetched by async copies
    for name in ("w2s3_t1", "w2s3_t1ds", "w2_t5"):
        r = res[name]
        assert r["regs"] <= 128 and r["stack"] <= 256, (name, r)
        assert r["cp_async16"] >= 8, (name, r)
    assert res["chunked_t5"]["stack"] <= 256, res["chunked_t5"]
    assert res["chunked_t1"]["state_st_v4"] == 8            # 32x128 chunk: 8 x 16 B per thread
    assert res["chunked_t5"]["state_st_v4"] == 40           # one chunk write per token
    assert res["chunked_t2rec"]["state_st_v4"] == 0         # record mode: no state write
    # gate_mode 0: one accumulator chain through the 4 K-slices; gate_mode 1: 4 separate
    # chains (Triton must not fold "acc + dot(a, b, 0)" into "dot(a, b, acc)")
    assert (res["t1"]["dots"], res["t1"]["chained_dots"]) == (4, 3), res["t1"]
    assert (res["t1ds"]["dots"], res["t1ds"]["chained_dots"]) == (4, 0), res["t1ds"]


@pytest.mark.skipif(INTERP or not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("variant", ["item", "vsplit4", "persistent", "chunked"])
def test_cuda_graph_capture(variant):
    cfg = KdaConfig(num_heads=4, T=2, window=4)
    spec = CaseSpec(cfg, R=6, seed=9)
    eager = make_case(spec, "cuda")
    graphed = clone_args(eager)
    step = kd.build_step(cfg, "cuda", variant)
    warm = clone_args(eager)
    step(warm)                                  # compile and grow the scratch outside capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step(graphed)
    step(eager)
    g.replay()
    torch.cuda.synchronize()
    for name in ("out", "state", "conv_state"):
        assert bits_equal(getattr(eager, name), getattr(graphed, name)), name


@pytest.mark.skipif(INTERP or not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("variant", ["vsplit2", "chunked"])
def test_buffers_of_a_stream_first_seen_in_capture(variant, monkeypatch):
    """torch.cuda.graph captures on its own stream, which the eager warm-up never ran on: its
    scratch is made during capture (from the graph's pool) and its V-split counters are the
    spare zeroed by an eager step. Two graphs captured there share them; the second one
    replayed first, then both twice, match eager steps bit for bit (with counters made during
    capture, zeroed only by the first graph's fill node, B replayed first read garbage)."""
    from kda.backends.triton import kda_decode_chunked as kc
    monkeypatch.setattr(kc, "_SCRATCH", {})
    cfg = KdaConfig(num_heads=2, T=2, window=4)
    step = kd.build_step(cfg, "cuda", variant)
    step(make_case(CaseSpec(cfg, R=3, seed=18), "cuda"))       # compile (on the current stream)
    torch.cuda.synchronize()
    eager = [make_case(CaseSpec(cfg, R=r, seed=19 + r), "cuda") for r in (3, 2)]
    graphed = [clone_args(a) for a in eager]
    graphs = [torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()]
    for g, a in zip(graphs, graphed):
        with torch.cuda.graph(g):
            step(a)
    for i in (1, 0, 1, 0):
        step(eager[i])
        graphs[i].replay()
    torch.cuda.synchronize()
    for e, g in zip(eager, graphed):
        for name in ("out", "state", "conv_state"):
            assert bits_equal(getattr(e, name), getattr(g, name)), name


@pytest.mark.skipif(INTERP or not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("variant", ["vsplit4", "chunked"])
def test_two_streams_at_once(variant, monkeypatch):
    """One built step launched on two streams at once (as a server overlapping two
    micro-batches does): each stream has its own scratch (and counters), so both batches
    match the reference. The two launches of each round are held behind one event after a
    GPU sleep, so that they run at the same time (small grids: both fit on the GPU at once)."""
    from kda.backends.triton import kda_decode_chunked as kc
    monkeypatch.setattr(kc, "_SCRATCH", {})
    cfg = KdaConfig(num_heads=4, T=2, window=4)
    step = kd.build_step(cfg, "cuda", variant)
    runs = []
    for seed in (71, 72):
        args = make_case(CaseSpec(cfg, R=3, seed=seed), "cuda")
        before, expected = clone_args(args), clone_args(args)
        for _ in range(4):
            reference_step(cfg, expected)
        runs.append((args, expected, before))
    torch.cuda.synchronize()
    gate, streams = torch.cuda.Stream(), [torch.cuda.Stream(), torch.cuda.Stream()]
    for _ in range(4):
        ev = torch.cuda.Event()
        with torch.cuda.stream(gate):
            torch.cuda._sleep(20_000_000)            # ~10 ms: both launches queue behind it
            ev.record()
        for (args, _, _), st in zip(runs, streams):
            st.wait_event(ev)
            with torch.cuda.stream(st):
                step(args)
        for st in streams:
            gate.wait_stream(st)
    torch.cuda.synchronize()
    for args, expected, before in runs:
        errors = compare_step(args, expected, before)
        assert not errors, "\n".join(errors)
    bufs = []
    for st in streams:
        with torch.cuda.stream(st):
            bufs.append(step._scr)
    assert bufs[0].data_ptr() != bufs[1].data_ptr()
