"""The measured choices of the CuTe DSL backends: which kernel ``cutedsl`` runs for a batch's
load (and, in one rule, its head count), and whether the one-CTA-per-item kernel commits its
state page last.

Figures are step times on an H200 (``python3 -m tools.bench.bench``: CUDA-graph replay, 8 GiB
state pool, softplus gate, SD layout; T=1 unless named).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

#: ``cutedsl``: the kernel for a batch of ``items = R * H`` (request, head) items at T tokens,
#: by state pool dtype and T (a T takes the row of the largest key not above it), first match of (most
#: items, kernel): ``splitC`` runs each item on a cluster of C CTAs
#: (:mod:`kda.backends.cutedsl.split`), ``stream`` on the persistent CTAs
#: (:mod:`kda.backends.cutedsl.stream`), ``streamg`` on them with each consumer group
#: preparing its own items (T = 1), ``streamC`` on CTAs of C items (one head, C requests;
#: the CTAs in flight then stream the contiguous pages of a few requests), ``wide`` on one CTA
#: (:mod:`kda.backends.cutedsl.wide`).
#: Step times: every kernel of the family at the rows' edges in one run (``docs/design.md``;
#: the 384-item cell and the bf16 rows of T >= 5 in runs of their own, same kernels), and for
#: the fp32 split rows of T = 5 and above the split-against-wide comparison at T = 4. The
#: bf16 figures of T = 2-4 are of unrolled consumers; the looped ones it runs there are faster
#: (``docs/design.md``).
#: The fp32 rows of T = 2-4 (one row, keyed 2) are from one sweep of ``wide``, ``stream``,
#: ``stream4`` and ``stream8`` beside ``touch`` (graph replay, two runs, 2026-12-03).
#: fp32 pages at T=1: CTAs of 4 items in blocks of 4 requests from this many items (ratio to
#: touch, H=32 R=32: 1.116 against 1.155 stream; 768 items, H=12 R=64: 1.265 against 1.169,
#: where 192 CTAs leave the second wave part full)
STREAM4_FROM = 1024

KERNEL_BY_ITEMS = {
    "fp32": {
        1: ((32, "split8"),    # H=32 R=1: 3.7 us against 4.3 split4, 5.2 stream
            (96, "stream"),    # H=32 R=3: 7.3 us against 7.7 streamg, 8.9 split4; H=96 R=1 7.3 against 7.8
            (256, "streamg"),  # H=12 R=16: 11.6 us against 13.0 stream; H=32 R=8 13.6 against 14.5
            (STREAM4_FROM - 1, "stream"),  # H=12 R=32: 18.5 us against 19.6 streamg
            (None, "stream4")),  # ratio to touch, H=32 R=512 1.060 against 1.114 stream
        2: ((48, "split8"),     # T=4 H=12 R=4: 8.7 us against 9.4 split4, 13.0 stream
            (1023, "stream"),   # T=4 H=96 R=8: 77.0 us against 81.5 wide, 85.2 in blocks of 4;
                                # H=12 R=64 77.0 against 79.2 wide; T=3 H=96 R=8 63.4 against 68.2
            (None, "stream4")),  # T=4 H=32 R=32: 99.4 us against 102.9 stream, 104.3 wide; H=96
                                 # R=16 148.5 against 159.3 wide; H=12 R=128 150.0 against 154.5;
                                 # H=96 R=128 1168 against 1184; at T=4 wide from 3072
                                 # to 4096 items of 16-32 heads (WIDE_T4);
                                 # T=3 H=32 R=32 80.2 against 83.4 stream; T=2 H=32 R=32 60.3
                                 # against 62.6 stream
        5: ((48, "split8"),     # T=4 H=12 R=1: 5.1 us against 11.7 wide
            (96, "split4"),     # T=4 H=96 R=1: 14.9 us against 16.1 wide
            (None, "wide")),    # T=8 H=32 R=32: 184.0 us against 199.3 stream
    },
    "bf16": {
        1: ((32, "split8"),     # H=32 R=1: 3.6 us against 4.1 split4, 5.1 stream
            (64, "split4"),     # H=32 R=2: 4.6 us against 5.1 streamg
            (4095, "streamg"),  # H=32 R=3: 5.4 us against 5.8 stream, 5.9 split4; H=32 R=64 47.5 against 49.5
            (None, "stream")),  # H=12 R=512: 127.1 us against 129.1 streamg (H=32 R=128: equal)
        2: ((32, "split8"),     # T=4 H=12 R=1: 5.1 us against 6.5 split4
            (96, "split4"),     # T=4 H=12 R=4: 7.6 us against 8.3 split8; H=12 R=8 10.4 against 11.5
            (None, "stream")),  # T=4 H=32 R=8: 19.6 us against 23.0 wide; R=128 263.3 against 312.9
        5: ((32, "split8"),     # as at T = 2-4 (T=4 H=12 R=4: split4 ahead of split8)
            (96, "split4"),     # T=5 H=12 R=8: 12.1 us against 13.6 stream, 14.4 wide
            (None, "stream")),  # T=6 H=12 R=16: 22.1 us against 25.4 wide; T=8 H=32 R=128 405.4 against 533.9
    },
}


def _state(state_bf16: bool) -> str:
    return "bf16" if state_bf16 else "fp32"


def table(T: int, state_bf16: bool = False) -> tuple:
    """The (most items, kernel) rows for ``T`` tokens on a pool of fp32 (or bf16) pages
    (:data:`KERNEL_BY_ITEMS`)."""
    rows = KERNEL_BY_ITEMS[_state(state_bf16)]
    return rows[max(t for t in rows if t <= T)]


#: The wide kernel commits its state page as its own cp.async group after the operands
#: (:attr:`kda.backends.cutedsl.static.KernelStatic.page_last`), by T; a T above the largest
#: key takes its entry. Step times at R = 32 / 128 / 512 (H=32), page last against one group.
PAGE_LAST = {
    1: True,   # faster: 164.3 / 627.3 us at R = 128 / 512 against 168.2 / 645.2
    2: True,   # faster up to R=128: 67.0 / 242.9 / 998 us against 68.3 / 250.2 / 989
    3: True,   # faster: T=3 84.7 / 316.2 / 1214.2 us against 86.0 / 317.6 / 1225.3; T=5 equal
}


class WideRule(NamedTuple):
    """Where ``wide`` replaces the table's ``stream4``: fp32 pages at T = 4, a range of items
    and of heads per request (both ends included)."""
    first_items: int
    last_items: int
    least_heads: int
    most_heads: int


#: fp32 pages at T = 4: ``wide`` instead of ``stream4`` from 3072 to 4096 items of 16-32
#: heads. One sweep of the two beside ``touch`` (H200, 2026-12-03, ``docs/design.md``, with
#: ``stream4``'s head lines held in L2): ``wide`` ahead at H=16 R=192 (294.4 us against 297.1)
#: and H=32 R=128 (387.8 against 392.1), behind by 0.2% at H=32 R=96 (293.1 against 292.5);
#: ``stream4`` ahead or level in the 9 other cells from 3072 items at H = 12-64 (by up to 1.6%,
#: H=64 R=48 292.4 against 297.0).
WIDE_T4 = WideRule(first_items=3072, last_items=4096, least_heads=16, most_heads=32)


def wide_by_heads(items: int, T: int, state_bf16: bool, heads: int) -> bool:
    """Whether ``cutedsl`` runs ``wide`` for ``items`` items of ``heads`` heads at ``T``
    tokens where its table names ``stream4`` (:data:`WIDE_T4`)."""
    r = WIDE_T4
    return (not state_bf16 and T == 4 and r.first_items <= items <= r.last_items
            and r.least_heads <= heads <= r.most_heads)


def table_kernel(items: int, T: int, state_bf16: bool = False) -> str:
    """The kernel of :data:`KERNEL_BY_ITEMS`' row for ``items`` items at ``T`` tokens on fp32
    (``state_bf16``: bf16) pages, before the head-count rule (what runs: :func:`kernel_for`)."""
    for most, kind in table(T, state_bf16):
        if most is None or items <= most:
            return kind
    raise AssertionError("every KERNEL_BY_ITEMS row ends with a catch-all entry")


def kernel_for(items: int, T: int, state_bf16: bool, heads: int) -> str:
    """The kernel ``cutedsl`` runs for ``items`` (request, head) items of ``heads`` heads per
    request at ``T`` tokens on a pool of fp32 (``state_bf16``: bf16) pages: the row of
    :data:`KERNEL_BY_ITEMS`, then the head-count rule :data:`WIDE_T4`."""
    kind = table_kernel(items, T, state_bf16)
    if kind == "stream4" and wide_by_heads(items, T, state_bf16, heads):
        return "wide"
    return kind


def table_kernels(T: int, state_bf16: bool = False) -> tuple:
    """The kernels of :data:`KERNEL_BY_ITEMS`' row for ``T`` tokens on fp32 (bf16) pages, in
    table order, each once (before the head-count rule: :func:`kernels`)."""
    return tuple(dict.fromkeys(kind for _, kind in table(T, state_bf16)))


def kernels(T: int, state_bf16: bool, heads: int) -> tuple:
    """Every kernel ``cutedsl`` may run at ``T`` tokens on fp32 (bf16) pages for ``heads``
    heads per request, in table order, ``wide`` last where only the head-count rule names it."""
    kinds = table_kernels(T, state_bf16)
    if "wide" not in kinds and wide_by_heads(WIDE_T4.first_items, T, state_bf16, heads):
        kinds += ("wide",)
    return kinds


def reads_early(kind: str, state_bf16: bool) -> bool:
    """Whether kernel ``kind`` on fp32 (``state_bf16``: bf16) pages honours
    ``KdaConfig.early_reads``: where that measured faster, the persistent walk on fp32 pages
    (H=12 T=1 R=8 6.5 us against 7.3, R=32 1.150-1.160 of touch against 1.199-1.203; T=4 R=32
    37.7-37.9 us against 38.8). On bf16 pages (H=96 R=128 1.187 against 1.177-1.179, T=4 H=32
    R=128 1.173 against 1.167-1.168) and in blocks of 4 requests (H=32 R=128 1.086 against
    1.082-1.083) it is slower; the other kernels have no early path (H200, 2026-12-03)."""
    return kind == "stream" and not state_bf16


def page_last(T: int) -> bool:
    """Whether the wide kernel at ``T`` tokens commits its state page last (:data:`PAGE_LAST`)."""
    return PAGE_LAST[min(T, max(PAGE_LAST))]


def cluster_of(kind: str) -> Optional[int]:
    """C of a ``splitC`` kernel name, None for the others."""
    return int(kind[5:]) if kind.startswith("split") else None


#: C of the ``streamC`` kernels that build (CTAs of C items in blocks of C requests)
STREAM_BLOCKS = (2, 4, 8, 16)


def block_of(kind: str) -> Optional[int]:
    """C of a ``streamC`` kernel name (CTAs of C items), None for the others."""
    return int(kind[6:]) if kind.startswith("stream") and kind[6:].isdigit() else None


def ctas(kind: str, items: int, sms: int) -> int:
    """The grid of kernel ``kind`` for ``items`` items on ``sms`` multiprocessors: one CTA
    per C items for ``streamC``, else one per SM and at most one per item (the persistent
    streamed kernel's grid; the wide and split kernels do not read it)."""
    block = block_of(kind)
    return min(sms, items) if block is None else -(-items // block)
