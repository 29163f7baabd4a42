"""The bf16-state builds compiled for sm_90a without a GPU (as ``test_compile_item.py``): the
page moves in 8-byte accesses in the fp32 tile's own layout (4 values a thread, as many
accesses as an fp32 page's 16-byte ones: a 16-byte bf16 access would put the tile through a
layout conversion), every state store converts with round-to-nearest-even
(``cvt.rn.bf16x2.f32``, never a truncating or directed rounding), and the state tile keeps
its layout. The fp32 builds' code does not depend on the bf16 path
(the state dtype is a constexpr); their figures are ``test_compile_item.py``'s. Runs with or
without ``TRITON_INTERPRET``."""

import pytest

pytest.importorskip("triton")

from tests.backends.triton.helpers import offline_figures  # noqa: E402


def test_bf16_state_builds(tmp_path):
    res = offline_figures({
        "nv1_t1": ("item_nv1", "T1"), "nv1_t1_s16": ("item_nv1", "T1S16"),
        "nv4_t2_s16": ("item_nv4", "T2S16"), "chunked_t1_s16": ("chunked", "T1S16"),
        "chunked_t2_s16": ("chunked", "T2S16")}, tmp_path)
    for name, r in res.items():
        assert r["cvt_bf16_not_rn"] == 0, (name, r)      # every bf16 conversion rounds to nearest
    fp32, s16 = res["nv1_t1"], res["nv1_t1_s16"]
    assert s16["stack"] == 0 and s16["regs"] <= 128, s16
    # 32 KiB on 256 threads: 16 x 8 B each way, no 16-byte access
    assert (s16["state_ld_v2"], s16["state_st_v2"]) == (16, 16), s16
    assert (s16["state_ld_v4"], s16["state_st_v4"]) == (0, 0), s16
    # the page's 64 values a thread, rounded in pairs on the one store
    assert s16["cvt_bf16x2"] - fp32["cvt_bf16x2"] == 32, (fp32, s16)
    assert res["nv4_t2_s16"]["state_ld_v2"] == 8, res["nv4_t2_s16"]  # 32 rows on 4 warps
    for name in ("nv4_t2_s16", "chunked_t1_s16", "chunked_t2_s16"):
        assert res[name]["cvt_bf16x2"] > fp32["cvt_bf16x2"] // 2, (name, res[name])
        assert res[name]["state_st_v2"] > 0, (name, res[name])
