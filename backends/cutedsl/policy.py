"""The measured choices of the CuTe DSL backends: which kernel ``cutedsl`` runs for a batch's
load, and whether the one-CTA-per-item kernel commits its state page last.

Figures are step times on an H200 (``python3 -m tools.bench.bench``: CUDA-graph replay, 8 GiB
state pool, softplus gate, SD layout; T=1 unless named).
"""

from __future__ import annotations

from typing import Optional

#: ``cutedsl``: the kernel for a batch of ``items = R * H`` (request, head) items at T tokens,
#: by T (a T above the largest key takes its row), first match of (most items, kernel):
#: ``splitC`` runs each item on a cluster of C CTAs (:mod:`kda.backends.cutedsl.split`),
#: ``wide`` on one CTA (:mod:`kda.backends.cutedsl.wide`). Step times against the wide kernel.
KERNEL_BY_ITEMS = {
    1: ((32, "split8"),   # H=12 R=1: 2.9 us against 5.8 wide, 3.6 split4; H=32 R=1: 3.7 against 6.5
        (64, "split4"),   # H=12 R=4: 4.6 us against 4.9 split8, 6.3 wide; H=32 R=2: 6.2 against 6.7 wide
        (None, "wide")),  # H=12 R=8: 8.6 us against 9.1 split4; H=32 R=4: 10.2 against 11.5 split2
    2: ((48, "split8"),   # T=4 H=12 R=1: 5.1 us against 11.7 wide; H=12 R=4: 8.7 against 9.4 split4
        (96, "split4"),   # T=4 H=96 R=1: 14.9 us against 16.1 wide; H=12 R=8: 14.8 against 15.8 wide
        (None, "wide")),  # T=4 H=32 R=4: 18.0 us against 20.5 split2; H=12 R=16: 24.0 against 24.8
}


def table(T: int) -> tuple:
    """The (most items, kernel) rows for ``T`` tokens (:data:`KERNEL_BY_ITEMS`)."""
    return KERNEL_BY_ITEMS[min(T, max(KERNEL_BY_ITEMS))]


#: The wide kernel commits its state page as its own cp.async group after the operands
#: (:attr:`kda.backends.cutedsl.static.KernelStatic.page_last`), by T; a T above the largest
#: key takes its entry. Step times at R = 32 / 128 / 512 (H=32), page last against one group.
PAGE_LAST = {
    1: True,   # faster: 164.3 / 627.3 us at R = 128 / 512 against 168.2 / 645.2
    2: True,   # faster up to R=128: 67.0 / 242.9 / 998 us against 68.3 / 250.2 / 989
    3: True,   # faster: T=3 84.7 / 316.2 / 1214.2 us against 86.0 / 317.6 / 1225.3; T=5 equal
}


def kernel_for(items: int, T: int) -> str:
    """The kernel ``cutedsl`` runs for ``items`` (request, head) items at ``T`` tokens."""
    for most, kind in table(T):
        if most is None or items <= most:
            return kind
    raise AssertionError("every KERNEL_BY_ITEMS row ends with a catch-all entry")


def kernels(T: int) -> tuple:
    """Every kernel ``cutedsl`` may run at ``T`` tokens, in table order."""
    return tuple(kind for _, kind in table(T))


def page_last(T: int) -> bool:
    """Whether the wide kernel at ``T`` tokens commits its state page last (:data:`PAGE_LAST`)."""
    return PAGE_LAST[min(T, max(PAGE_LAST))]


def cluster_of(kind: str) -> Optional[int]:
    """C of a ``splitC`` kernel name, None for ``wide``."""
    return int(kind[5:]) if kind.startswith("split") else None
