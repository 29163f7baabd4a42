"""The per-item kernel's builds compiled for sm_90a without a GPU (Triton's bundled ptxas,
:mod:`kda.backends.triton.offline`): the register cap, no spills where none are expected,
16-byte vector state accesses, the gate's accumulation order, the V-split's acq_rel atomic
(and, for every case, the state tile never converted to another layout, the gate on tensor
cores: :func:`tests.backends.triton.helpers.offline_figures`); the build for rows that are
not 16-byte aligned with an activated fp32 beta compiles to the same page accesses. Runs with
or without ``TRITON_INTERPRET``."""

import pytest

pytest.importorskip("triton")

from tests.backends.triton.helpers import offline_figures  # noqa: E402


def test_item_builds(tmp_path):
    res = offline_figures({
        "nv1_t1": ("item_nv1", "T1"), "nv1_t1ds": ("item_nv1", "T1DS"),
        "nv1_t5": ("item_nv1", "T5"), "nv1_t2rec": ("item_nv1", "T2REC"),
        "nv2_t5": ("item_nv2", "T5"), "nv4_t2": ("item_nv4", "T2"),
        "nv1_rows": ("item_nv1", "T1BETA", False), "nv4_rows": ("item_nv4", "T1BETA", False)},
        tmp_path)
    # rows that are not 16-byte aligned: the same 16-byte page accesses, no spill
    for name, aligned in (("nv1_rows", "nv1_t1"), ("nv4_rows", "nv4_t2")):
        r = res[name]
        assert r["stack"] == 0 and r["state_ld_v4"] == res[aligned]["state_ld_v4"], (name, r)
    assert res["nv1_rows"]["regs"] <= 128 and res["nv1_rows"]["state_st_v4"] == 16
    for name in ("nv1_t1", "nv1_t1ds", "nv1_t5", "nv1_t2rec"):
        r = res[name]
        assert r["regs"] <= 128, (name, r)             # two 8-warp programs per SM
        assert r["state_ld_v4"] == 16, (name, r)       # 64 KiB page: 16 x 16 B per thread
        assert r["atom"] == 0, (name, r)               # no counter without a V-split
    for name in ("nv1_t1", "nv1_t1ds", "nv1_t2rec", "nv2_t5", "nv4_t2"):
        assert res[name]["stack"] == 0, (name, res[name])  # no spill
    assert res["nv1_t5"]["stack"] <= 64, res["nv1_t5"]       # T>2: a few spilled values
    assert res["nv1_t1"]["state_st_v4"] == 16
    assert res["nv1_t5"]["state_st_v4"] == 16                # token loop: one page write each
    assert res["nv1_t2rec"]["state_st_v4"] == 0              # record mode: no state write
    assert res["nv2_t5"]["state_ld_v4"] == 16                # 64 rows on 4 warps
    assert res["nv4_t2"]["state_ld_v4"] == 8                 # 32 rows on 4 warps
    for name in ("nv2_t5", "nv4_t2"):
        assert res[name]["atom"] == 1, (name, res[name])     # the last-arriver counter
    # gate_mode 0: one accumulator chain through the 4 K-slices; gate_mode 1: 4 separate
    # chains (Triton must not fold "acc + dot(a, b, 0)" into "dot(a, b, acc)")
    assert (res["nv1_t1"]["dots"], res["nv1_t1"]["chained_dots"]) == (4, 3), res["nv1_t1"]
    assert (res["nv1_t1ds"]["dots"], res["nv1_t1ds"]["chained_dots"]) == (4, 0), res["nv1_t1ds"]
