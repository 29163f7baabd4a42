"""Which :class:`kda.backends.cutedsl.schedule.Schedule` ``cutedsl`` runs for a batch.

On a GPU with a measured table (:mod:`kda.backends.cutedsl.tables`, written by ``tools/kda
tune``) the table's row decides. Any other GPU gets the default below: rows of the step's
load in *waves*, items over the GPU's multiprocessors, measured on a 132-SM H200
(:data:`REFERENCE_SMS`; ``python3 -m tools.bench.bench``: CUDA-graph replay, 8 GiB state pool,
softplus gate, SD layout; T=1 unless named). A row is written as the item count it was
measured at on that GPU; on one of ``sms`` multiprocessors the bound is ``most * sms / 132``
items.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Tuple

from kda.backends.cutedsl import schedule as S
from kda.backends.cutedsl.problem import Problem

#: The multiprocessors of the GPU the default rows were measured on (an H200).
REFERENCE_SMS = 132

#: The axes of the schedules the default names (:meth:`Schedule.axes`).
SPLIT8 = {"rows": "cluster", "prep": "cluster", "items": "one", "cluster": 8}
SPLIT4 = {"rows": "cluster", "prep": "cluster", "items": "one", "cluster": 4}
STREAM = {"rows": "warp", "prep": "warpgroup", "items": "range"}
STREAMG = {"rows": "warp", "prep": "group", "items": "range"}
STREAM4 = {"rows": "warp", "prep": "warpgroup", "items": "blocks", "block": 4}
WIDE = {"rows": "cta", "prep": "inline", "items": "one"}

#: fp32 pages at T=1: CTAs of 4 items in blocks of 4 requests from this many items (ratio to
#: touch, H=32 R=32: 1.116 against 1.155 stream; 768 items, H=12 R=64: 1.265 against 1.169,
#: where 192 CTAs leave the second wave part full)
STREAM4_FROM = 1024

#: The default: by state pool dtype and T (a T takes the row of the largest key not above
#: it), the first (most items at :data:`REFERENCE_SMS` SMs, schedule axes) whose bound the
#: batch's items do not pass (None: any). Step times: every schedule at the rows' edges in one
#: run (``docs/design.md``; the 384-item cell and the bf16 rows of T >= 5 in runs of their
#: own), and for the fp32 split rows of T = 5 and above the split-against-wide comparison at
#: T = 4. The bf16 figures of T = 2-4 are of unrolled consumers; the looped ones it runs there
#: are faster (``docs/design.md``). The fp32 rows of T = 2-4 (one row, keyed 2) are from one
#: sweep of ``wide``, ``stream``, ``stream4`` and ``stream8`` beside ``touch`` (graph replay,
#: two runs, 2026-12-03).
DEFAULT = {
    "fp32": {
        1: ((32, SPLIT8),    # H=32 R=1: 3.7 us against 4.3 split4, 5.2 stream
            (96, STREAM),    # H=32 R=3: 7.3 us against 7.7 streamg, 8.9 split4; H=96 R=1 7.3
                             # against 7.8
            (256, STREAMG),  # H=12 R=16: 11.6 us against 13.0 stream; H=32 R=8 13.6 against 14.5
            (STREAM4_FROM - 1, STREAM),  # H=12 R=32: 18.5 us against 19.6 streamg
            (None, STREAM4)),  # ratio to touch, H=32 R=512 1.060 against 1.114 stream
        2: ((48, SPLIT8),     # T=4 H=12 R=4: 8.7 us against 9.4 split4, 13.0 stream
            (STREAM4_FROM - 1, STREAM),  # T=4 H=96 R=8: 77.0 us against 81.5 wide, 85.2 in
                              # blocks of 4; H=12 R=64 77.0 against 79.2 wide; T=3 H=96 R=8
                              # 63.4 against 68.2
            (None, STREAM4)),  # T=4 H=32 R=32: 99.4 us against 102.9 stream, 104.3 wide; H=96
                               # R=16 148.5 against 159.3 wide; H=12 R=128 150.0 against 154.5;
                               # H=96 R=128 1168 against 1184; at T=4 wide from 3072
                               # to 4096 items of 16-32 heads (WIDE_T4);
                               # T=3 H=32 R=32 80.2 against 83.4 stream; T=2 H=32 R=32 60.3
                               # against 62.6 stream
        5: ((48, SPLIT8),     # T=4 H=12 R=1: 5.1 us against 11.7 wide
            (96, SPLIT4),     # T=4 H=96 R=1: 14.9 us against 16.1 wide
            (None, WIDE)),    # T=8 H=32 R=32: 184.0 us against 199.3 stream
    },
    "bf16": {
        1: ((32, SPLIT8),     # H=32 R=1: 3.6 us against 4.1 split4, 5.1 stream
            (64, SPLIT4),     # H=32 R=2: 4.6 us against 5.1 streamg
            (4095, STREAMG),  # H=32 R=3: 5.4 us against 5.8 stream, 5.9 split4; H=32 R=64 47.5
                              # against 49.5
            (None, STREAM)),  # H=12 R=512: 127.1 us against 129.1 streamg (H=32 R=128: equal)
        2: ((32, SPLIT8),     # T=4 H=12 R=1: 5.1 us against 6.5 split4
            (96, SPLIT4),     # T=4 H=12 R=4: 7.6 us against 8.3 split8; H=12 R=8 10.4 against 11.5
            (None, STREAM)),  # T=4 H=32 R=8: 19.6 us against 23.0 wide; R=128 263.3 against 312.9
        5: ((32, SPLIT8),     # as at T = 2-4 (T=4 H=12 R=4: split4 ahead of split8)
            (96, SPLIT4),     # T=5 H=12 R=8: 12.1 us against 13.6 stream, 14.4 wide
            (None, STREAM)),  # T=6 H=12 R=16: 22.1 us against 25.4 wide; T=8 H=32 R=128
                              # 405.4 against 533.9
    },
}


class WideRule(NamedTuple):
    """Where the default runs ``WIDE`` in place of ``STREAM4``: fp32 pages at T = 4, a range
    of items (at :data:`REFERENCE_SMS` SMs) and of heads per request (both ends included)."""
    first_items: int
    last_items: int
    least_heads: int
    most_heads: int


#: fp32 pages at T = 4: ``WIDE`` instead of ``STREAM4`` from 3072 to 4096 items of 16-32
#: heads. One sweep of the two beside ``touch`` (H200, 2026-12-03, ``docs/design.md``, with
#: ``stream4``'s head lines held in L2): ``wide`` ahead at H=16 R=192 (294.4 us against 297.1)
#: and H=32 R=128 (387.8 against 392.1), behind by 0.2% at H=32 R=96 (293.1 against 292.5);
#: ``stream4`` ahead or level in the 9 other cells from 3072 items at H = 12-64 (by up to 1.6%,
#: H=64 R=48 292.4 against 297.0).
WIDE_T4 = WideRule(first_items=3072, last_items=4096, least_heads=16, most_heads=32)


def _state(state_bf16: bool) -> str:
    return "bf16" if state_bf16 else "fp32"


def default_rows(T: int, state_bf16: bool) -> tuple:
    """The default's (most items, axes) rows for ``T`` tokens on fp32 (bf16) pages."""
    rows = DEFAULT[_state(state_bf16)]
    return rows[max(t for t in rows if t <= T)]


def _within(items: int, most: int, sms: int) -> bool:
    """Whether ``items`` on ``sms`` SMs is at most ``most`` items on :data:`REFERENCE_SMS`."""
    return items * REFERENCE_SMS <= most * sms


def _wide_rule_applies(T: int, state_bf16: bool, heads: int) -> bool:
    """Whether :data:`WIDE_T4` is about this T, dtype and head count (at some items)."""
    r = WIDE_T4
    return not state_bf16 and T == 4 and r.least_heads <= heads <= r.most_heads


def wide_by_heads(items: int, T: int, state_bf16: bool, heads: int, sms: int) -> bool:
    """Whether the default runs ``WIDE`` where its row names ``STREAM4`` (:data:`WIDE_T4`)."""
    r = WIDE_T4
    return (_wide_rule_applies(T, state_bf16, heads) and
            not _within(items, r.first_items - 1, sms) and _within(items, r.last_items, sms))


def default_axes(items: int, T: int, state_bf16: bool, heads: int, sms: int) -> dict:
    """The default's schedule axes for ``items`` (request, head) items of ``heads`` heads per
    request at ``T`` tokens on fp32 (``state_bf16``: bf16) pages, on ``sms`` SMs."""
    for most, axes in default_rows(T, state_bf16):
        if most is None or _within(items, most, sms):
            if axes is STREAM4 and wide_by_heads(items, T, state_bf16, heads, sms):
                return WIDE
            return axes
    raise AssertionError("every DEFAULT row ends with a catch-all entry")


def reads_early(axes: dict, state_bf16: bool) -> bool:
    """Whether a schedule of ``axes`` on fp32 (``state_bf16``: bf16) pages reads early where
    ``KdaConfig.early_reads`` allows it: where that measured faster, the persistent walk on
    fp32 pages (H=12 T=1 R=8 6.5 us against 7.3, R=32 1.150-1.160 of touch against
    1.199-1.203; T=4 R=32 37.7-37.9 us against 38.8). On bf16 pages (H=96 R=128 1.187 against
    1.177-1.179, T=4 H=32 R=128 1.173 against 1.167-1.168) and in blocks of 4 requests (H=32
    R=128 1.086 against 1.082-1.083) it is slower; the other schedules have no early path
    (H200, 2026-12-03)."""
    return axes == STREAM and not state_bf16


def _axes(pb: Problem, items: int, sms: int, table) -> dict:
    """The axes for ``items`` items of ``pb``: ``table``'s row where it has one whose schedule
    serves ``pb`` (:func:`_serving`), else the default's."""
    if table is not None:
        axes = _serving(pb, table.axes_for(items, pb.T, pb.state_bf16, pb.H))
        if axes is not None:
            return axes
    return default_axes(items, pb.T, pb.state_bf16, pb.H, sms)


def _serving(pb: Problem, axes: Optional[dict]) -> Optional[dict]:
    """``axes`` where their schedule serves ``pb``; else, where only ``gate_batch`` keeps it
    from serving (record mode at T = 1: the tuner measures without records), the same axes
    without it, the measured walk being closer than the default's; else None."""
    if axes is None:
        return None
    if _serves(pb, axes):
        return axes
    if axes.get("gate_batch"):
        plain = {k: v for k, v in axes.items() if k != "gate_batch"}
        if _serves(pb, plain):
            return plain
    return None


def _schedule(pb: Problem, axes: dict, early_reads: bool) -> S.Schedule:
    """The schedule of ``axes`` for ``pb``, reading early where ``early_reads``
    (``KdaConfig.early_reads``) allows it and :func:`reads_early` says so."""
    return S.from_axes(pb, axes, early_reads=early_reads and reads_early(axes, pb.state_bf16))


def _serves(pb: Problem, axes: dict) -> bool:
    try:
        S.from_axes(pb, axes)
    except (ValueError, TypeError, KeyError):
        return False
    return True


def schedule_for(pb: Problem, items: int, sms: int, early_reads: bool = False,
                 table=None) -> S.Schedule:
    """The schedule ``cutedsl`` runs for ``items`` items of problem ``pb`` on a GPU of ``sms``
    SMs: the row of ``table`` (the GPU's :class:`kda.backends.cutedsl.tables.Table`) where it
    has one that serves ``pb``, else the default; reading early where ``early_reads``
    (``KdaConfig.early_reads``) allows it and :func:`reads_early` says so."""
    return _schedule(pb, _axes(pb, items, sms, table), early_reads)


def schedules(pb: Problem, sms: int, early_reads: bool = False, table=None) -> Tuple:
    """Every schedule :func:`schedule_for` may return for ``pb`` on ``sms`` SMs (any batch),
    each once, in row order."""
    all_axes = [axes for _, axes in default_rows(pb.T, pb.state_bf16)]
    if _wide_rule_applies(pb.T, pb.state_bf16, pb.H):
        all_axes.append(WIDE)
    if table is not None:
        measured = table.all_axes(pb.T, pb.state_bf16, pb.H)
        serving = [a for a in (_serving(pb, m) for m in measured) if a is not None]
        if serving:
            # the table decides every batch whose row serves pb, the default the others
            all_axes = serving + (all_axes if len(serving) < len(measured) else [])
    out = []
    for axes in all_axes:
        s = _schedule(pb, axes, early_reads)
        if s not in out:
            out.append(s)
    return tuple(out)
