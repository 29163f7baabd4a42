"""The measured defaults of the CuTe DSL kernels: items per CTA by T, page-last by kernel and T.

Each table is keyed by T; a T above the largest key takes the largest key's entry. Figures
are H200 measurements at H=32: fractions of the copy-bandwidth floor, or step times in us, at
the batch sizes R named in each table's comment.
"""

from __future__ import annotations

#: Streamed kernel: at most this many items per CTA (grid: :func:`kda.backend.stream_grid`,
#: never fewer than 2 CTAs per SM). Fraction of the floor at R = 128 / 512, against the
#: persistent grid (2 CTAs per SM, each walking items / CTAs items).
ITEMS_PER_CTA = {
    1: 4,  # closer to the floor: 0.781 / 0.838 against 0.773 / 0.823
    2: 2,  # closer to the floor: 0.755 / 0.775 against 0.739 / 0.772
    3: 1,  # closer: T=3 0.784 / 0.816 vs 0.743 / 0.774, T=5 0.807 / 0.827 vs 0.765 / 0.791
}

#: Whether a kernel commits its (first) item's state page last, in its own cp.async group
#: (:attr:`kda.backends.cutedsl.static.KernelStatic.page_last`), else with the operands in one
#: group. Step times at R = 32 / 128 / 512, page last against one group.
PAGE_LAST = {
    "wide": {
        1: True,   # faster: 164.3 / 627.3 us at R = 128 / 512 against 168.2 / 645.2
        2: True,   # faster up to R=128: 67.0 / 242.9 / 998 us against 68.3 / 250.2 / 989
        3: True,   # faster: T=3 84.7 / 316.2 / 1214.2 us against 86.0 / 317.6 / 1225.3; T=5 equal
    },
    "stream": {
        1: False,  # no gain: page last is within 0.4% either way (4 items per CTA)
        2: False,  # page last 2.8-3.8% slower: 73.4 / 270.9 / 1055.2 us vs 71.1 / 260.9 / 1026.3
        3: True,   # faster: T=3 90.7 / 329.4 / 1263.4 us against 91.0 / 335.9 / 1281.4; T=5 0.1%
    },
}


def _by_t(table: dict, T: int):
    return table[min(T, max(table))]


def items_per_cta(T: int) -> int:
    """The streamed kernel's items per CTA at ``T`` tokens (:data:`ITEMS_PER_CTA`)."""
    return _by_t(ITEMS_PER_CTA, T)


def page_last(kind: str, T: int) -> bool:
    """Whether kernel ``kind`` ("wide" / "stream") at ``T`` tokens commits the (first) item's
    state page last (:data:`PAGE_LAST`)."""
    return _by_t(PAGE_LAST[kind], T)
