"""tools/bench/cuda_trace.py's reading of the CUDA kernel's trace stamps, on synthetic stamps
(the trace build itself needs an sm_90 GPU: tools/gpu/session.sh's ``trace`` stage)."""

import numpy as np
import pytest

import pathlib
import re

from tools.bench.cuda_trace import CTAS, ITEMS, PHASES, POINTS, STRIDE, analyse, compact

GHZ = 2.0


def _stamps(steps=3, ctas=4, items=5, phase_ns=(500, 1000, 20, 1000, 4000, 100, 300),
            gap_ns=100, step_ns=200_000, skew_ns=10):
    """Stamps as the kernel writes them: CTA b of step k enters at k*step_ns + b*skew_ns,
    each item's eight points ``phase_ns`` apart, ``gap_ns`` between items, clock64 at GHZ."""
    tr = np.zeros((steps, CTAS, STRIDE), np.int64)
    for k in range(steps):
        for b in range(ctas):
            t0 = 10**12 + k * step_ns + b * skew_ns
            c0 = 7 * 10**9 + 1000 * b            # each SM's own clock origin
            clock = lambda ns: c0 + int(ns * GHZ)  # noqa: E731
            t = 1000 + 2000                        # wait at 1000 ns, loop at 3000 ns
            tr[k, b, 3], tr[k, b, 4], tr[k, b, 5] = clock(0), clock(1000), clock(t)
            for n in range(items):
                c = 8 + POINTS * n
                tr[k, b, c] = clock(t)
                for j, d in enumerate(phase_ns):
                    t += d
                    tr[k, b, c + j + 1] = clock(t)
                t += gap_ns
            t_exit = t + 500
            tr[k, b, 6], tr[k, b, 7] = clock(t_exit), items
            tr[k, b, 0], tr[k, b, 1], tr[k, b, 2] = t0, t0 + t_exit, b
    return tr


def test_phases_spans_and_gaps():
    tr = _stamps()
    rows = analyse(tr)
    assert [r["ctas"] for r in rows] == [4, 4, 4]
    per_item = sum((500, 1000, 20, 1000, 4000, 100, 300)) + 100
    for r in rows:
        assert r["wait"] == pytest.approx(1.0) and r["prologue"] == pytest.approx(2.0)
        for name, want in (("top>B1", 0.5), ("B1>conv", 1.0), ("conv>B2", 0.02), ("B2>B3", 1.0),
                           ("B3>rec", 4.0), ("rec>B4", 0.1), ("B4>end", 0.3)):
            assert r[name] == pytest.approx(want), name
        assert r["item_next"] == pytest.approx(0.1)
        assert r["ghz"] == pytest.approx(GHZ)
        assert r["entry_spread"] == pytest.approx(0.03)
        # the first page at loop start + the first three phases; the last item's end
        assert r["first_page"] == pytest.approx(0.015 + 3.0 + 1.52)
        assert r["last_end_med"] == pytest.approx(0.015 + 3.0 + 5 * per_item / 1000 - 0.1)
        assert r["span"] == pytest.approx((3000 + 5 * per_item + 500) / 1000 + 0.03)
    assert np.isnan(rows[0]["after_prev"])
    assert rows[1]["after_prev"] == pytest.approx(200.0 - rows[0]["span"])


def test_compact_form_reads_the_same():
    tr = _stamps(items=7)
    c = compact(tr)
    assert c.dtype == np.int32 and c.shape == (3, 4, 8 + POINTS * 7)
    for a, b in zip(analyse(tr), analyse(c)):
        for key in a:
            assert (np.isnan(a[key]) and np.isnan(b[key])) or a[key] == pytest.approx(b[key]), key


def test_dead_items_and_ctas_past_the_stamped_items():
    """A dead item (no B1 / rec / B4 stamps) is left out of those phases only; a CTA that
    walked more items than the trace holds has no last-item figure."""
    tr = _stamps(ctas=2)
    for j in (1, 5, 6):      # item 2 of CTA 0 dead
        tr[:, 0, 8 + POINTS * 2 + j] = 0
    tr[:, 1, 7] = ITEMS + 3  # CTA 1 walked past the stamped items
    rows = analyse(tr)
    assert rows[0]["top>B1"] == pytest.approx(0.5) and rows[0]["B3>rec"] == pytest.approx(4.0)
    assert rows[0]["last_end_min"] == rows[0]["last_end_med"]   # one CTA's figure only


def test_layout_matches_the_kernel():
    """The tool's stamp layout is the trace build's (kda_decode.h / kda_decode.cu)."""
    src = pathlib.Path(__file__).resolve().parents[3] / "backends" / "cuda"
    header = (src / "kda_decode.h").read_text()
    kernel = (src / "kda_decode.cu").read_text()
    assert int(re.search(r"#define KDA_TRACE_CTAS (\d+)", header).group(1)) == CTAS
    assert int(re.search(r"#define KDA_TRACE_STRIDE (\d+)", header).group(1)) == STRIDE
    assert int(re.search(r"kTracePoints = (\d+)", kernel).group(1)) == POINTS
    assert [p[0] for p in PHASES] == ["top>B1", "B1>conv", "conv>B2", "B2>B3", "B3>rec",
                                      "rec>B4", "B4>end"]
