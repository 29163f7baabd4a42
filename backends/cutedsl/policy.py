"""The measured choices of the CuTe DSL backends: which kernel ``cutedsl`` runs for a batch's
load, and whether the one-CTA-per-item kernel commits its state page last.

Figures are step times on an H200 (CUDA-graph replay, 8 GiB state pool, T=1 unless named).
"""

from __future__ import annotations

from typing import Optional

#: ``cutedsl``: the kernel for a batch of ``items = R * H`` (request, head) items, first match
#: of (most items, kernel): ``splitC`` runs each item on a cluster of C CTAs
#: (:mod:`kda.backends.cutedsl.split`), ``wide`` on one CTA (:mod:`kda.backends.cutedsl.wide`).
KERNEL_BY_ITEMS = (
    (48, "split8"),   # H=12 R=1: 3.0 us against 3.8 on 4 CTAs, 6.0 wide; H=32 R=1: 3.9 / 4.6 / 6.5
    (160, "split4"),  # H=12 R=8: 7.3 us against 7.6 on 2 CTAs, 8.6 on 8, 8.8 wide; H=96 R=1: 7.5 / 8.1 / 8.8 / 9.2
    (320, "split2"),  # H=32 R=8: 14.1 us against 18.4 on 4 CTAs, 17.1 on 8, 14.7 wide
    (None, "wide"),   # H=12 R=32: 22.6 us against 23.3 on 2 CTAs; H=32 R=128: 164.6 against 199.2
)

#: The wide kernel commits its state page as its own cp.async group after the operands
#: (:attr:`kda.backends.cutedsl.static.KernelStatic.page_last`), by T; a T above the largest
#: key takes its entry. Step times at R = 32 / 128 / 512 (H=32), page last against one group.
PAGE_LAST = {
    1: True,   # faster: 164.3 / 627.3 us at R = 128 / 512 against 168.2 / 645.2
    2: True,   # faster up to R=128: 67.0 / 242.9 / 998 us against 68.3 / 250.2 / 989
    3: True,   # faster: T=3 84.7 / 316.2 / 1214.2 us against 86.0 / 317.6 / 1225.3; T=5 equal
}


def kernel_for(items: int) -> str:
    """The kernel ``cutedsl`` runs for ``items`` (request, head) items (:data:`KERNEL_BY_ITEMS`)."""
    for most, kind in KERNEL_BY_ITEMS:
        if most is None or items <= most:
            return kind
    raise AssertionError("KERNEL_BY_ITEMS ends with a catch-all entry")


def kernels() -> tuple:
    """Every kernel ``cutedsl`` may run, in the order of :data:`KERNEL_BY_ITEMS`."""
    return tuple(kind for _, kind in KERNEL_BY_ITEMS)


def page_last(T: int) -> bool:
    """Whether the wide kernel at ``T`` tokens commits its state page last (:data:`PAGE_LAST`)."""
    return PAGE_LAST[min(T, max(PAGE_LAST))]


def cluster_of(kind: str) -> Optional[int]:
    """C of a ``splitC`` kernel name, None for ``wide``."""
    return int(kind[5:]) if kind.startswith("split") else None
