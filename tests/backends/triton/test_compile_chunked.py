"""The chunked kernel's builds compiled for sm_90a without a GPU (Triton's bundled ptxas,
:mod:`kda.backends.triton.offline`): the register caps, no spills at T=1 where none are
expected, the state chunks prefetched by the software pipeliner with the build's stages, one
chunk write per token, the gate's accumulation order (and, for every case, the state tile
never converted to another layout, the gate on tensor cores:
:func:`tests.backends.triton.helpers.offline_figures`). Runs with or without
``TRITON_INTERPRET``. The build for rows that are not 16-byte aligned, with an activated fp32
beta, keeps the pipelined page chunks."""

import pytest

pytest.importorskip("triton")

from tests.backends.triton.helpers import offline_figures  # noqa: E402

# name: (build, config, async copies of 16 bytes per thread and stage)
CASES = {
    "c_t1": ("chunked", "T1", 8), "c_t1ds": ("chunked", "T1DS", 8),
    "c_t5": ("chunked", "T5", 8), "c_t2rec": ("chunked", "T2REC", 8),
    "w2s3_t1": ("chunked_w2_s3", "T1", 8), "w2s3_t1ds": ("chunked_w2_s3", "T1DS", 8),
    "w2_t5": ("chunked_w2", "T5", 8), "bv16_t5": ("chunked_bv16", "T5", 4),
    "w2s3_rows": ("chunked_w2_s3", "T1BETA", 8, False),
}


def test_chunked_builds(tmp_path):
    from kda.backends.triton.kda_decode_chunked import BUILDS
    res = offline_figures({n: (b, c, *rows) for n, (b, c, _, *rows) in CASES.items()}, tmp_path)
    for name, (build, _, per_stage, *_) in CASES.items():
        r, b = res[name], BUILDS[build]
        assert r["regs"] <= b.maxnreg, (name, r)       # 88: 5 programs of 4 warps per SM;
        #                                                128: 8 programs of 2 warps per SM
        # the state chunk prefetched by the software pipeliner: one async copy of the chunk
        # per stage (prologue and loop), 16 bytes per copy instruction
        assert r["state_async"] == b.num_stages, (name, r)
        assert r["cp_async16"] == b.num_stages * per_stage, (name, r)
        assert r["stack"] <= 256, (name, r)
    for name in ("c_t1", "c_t1ds", "c_t2rec", "w2s3_t1"):
        assert res[name]["stack"] == 0, (name, res[name])   # no spill
    assert res["w2s3_rows"]["state_st_v4"] == res["w2s3_t1"]["state_st_v4"]
    assert res["c_t1"]["state_st_v4"] == 8                  # 32x128 chunk: 8 x 16 B per thread
    assert res["c_t5"]["state_st_v4"] == 40                 # one chunk write per token
    assert res["w2_t5"]["state_st_v4"] == 40                # 16x128 chunk on 2 warps: 8
    assert res["bv16_t5"]["state_st_v4"] == 20              # 16x128 chunk on 4 warps: 4
    assert res["c_t2rec"]["state_st_v4"] == 0               # record mode: no state write
    assert (res["c_t1"]["dots"], res["c_t1"]["chained_dots"]) == (4, 3), res["c_t1"]
    assert (res["c_t1ds"]["dots"], res["c_t1ds"]["chained_dots"]) == (4, 0), res["c_t1ds"]
