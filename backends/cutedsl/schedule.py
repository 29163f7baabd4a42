"""The schedule record of the CuTe DSL kernel family: how a kernel lays out a step's work.

A kernel is compiled for a :class:`kda.backends.cutedsl.problem.Problem` (what the step is:
heads, tokens, layouts, dtypes) and a :class:`Schedule` (how the kernel does it); the pair is
the compile key. A schedule is a value along a few axes, not a named kernel:

* :class:`Rows`, how an item's 128 value rows are cut: all of them in one CTA (``CTA``),
  ``unit_rows``-row units, one per consumer warp, streamed through a shared-memory ring
  (``WARP``), or 128 / ``cluster`` rows per CTA of a cluster (``CLUSTER``);
* :class:`Prep`, where an item's prep (conv, norms, gate, decay, the epilogue's RMSNorm)
  runs: in the same threads before the recurrence (``INLINE``), on a prep warpgroup ahead of
  the consumers (``WARPGROUP``), in each consumer group for its own items with the gate on the
  prep warpgroup (``GROUP``), or on every CTA of the item's cluster (``CLUSTER``);
* :class:`Items`, which items a CTA takes: one (``ONE``; a cluster per item with ``CLUSTER``
  rows), a contiguous head-major range on a persistent grid (``RANGE``), or ``block`` items of
  one head and ``block`` consecutive requests at a time (``BLOCKS``), with ``tail`` the last
  wave's CTAs at ``block / 2`` items (:mod:`kda.backends.cutedsl.scheduler`);
* the ring: ``unit_rows``, ``consumers`` warps, ``depth`` stages per warp;
* flags: ``gate_batch`` (at T = 1 the prep computes the gate projections of up to 8
  consecutive items of one head in one MMA pass, one item per column), ``state_direct`` (the
  cluster kernel loads its CTA's state rows from global memory straight into registers,
  after the slot ids and the window history, instead of one bulk copy through shared
  memory), ``split_qk`` (the cluster kernel's CTAs each compute 256 / ``cluster`` of the q /
  k channels' conv and norm partial sums and send them to every CTA of the cluster, instead of
  every CTA computing all 256),
  ``early_reads`` (the first items' slot ids, windows and pages read before the PDL wait,
  :attr:`kda.config.KdaConfig.early_reads`), ``stage_fb`` (a head's f_b rows staged in
  shared memory), ``prefetch`` (the item after next brought to L2), ``x_ahead`` (x of the next
  item read ahead into registers), ``walk`` (the prep steps (request, head) from item to
  item), ``token_loop`` (the consumers' passes and tokens as loops), ``page_last`` (the
  one-CTA kernel commits the state page as its own copy group after the operands).

:func:`make` fills in every field a caller leaves out from the problem, by one rule each
(:func:`default_flags`). The kernels (:mod:`kda.backends.cutedsl.wide`, ``.split``,
``.stream``) read only these fields; which schedule runs is
:mod:`kda.backends.cutedsl.policy`'s choice. :attr:`Schedule.name` is a short name for logs
and tools only.

Pure Python: no CuTe DSL import.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import List, Optional

from kda.backends.cutedsl.problem import Problem

D = 128


class Rows(str, enum.Enum):
    """How an item's 128 value rows are cut."""
    CTA = "cta"            #: all 128 rows in one CTA of 256 threads (4 rows a thread)
    WARP = "warp"          #: ``unit_rows``-row units, one per consumer warp, via the ring
    CLUSTER = "cluster"    #: 128 / ``cluster`` rows per CTA of a cluster


class Prep(str, enum.Enum):
    """Where an item's prep runs."""
    INLINE = "inline"          #: the item's own threads, before its recurrence
    WARPGROUP = "warpgroup"    #: a prep warpgroup, items ahead of the consumers
    GROUP = "group"            #: each consumer group its own items' conv, norms, RMSNorm
    CLUSTER = "cluster"        #: every CTA of the item's cluster (a gate warp per CTA)


class Items(str, enum.Enum):
    """Which items a CTA (or cluster) takes."""
    ONE = "one"          #: one item (grid: R * H CTAs, or clusters)
    RANGE = "range"      #: a contiguous head-major range (grid: one CTA per SM)
    BLOCKS = "blocks"    #: ``block`` requests of one head at a time (grid: items / block)


#: Cluster sizes of ``Rows.CLUSTER`` (st.async needs a cluster of at least 2 CTAs).
CLUSTERS = (2, 4, 8)
#: Block sizes of ``Items.BLOCKS``.
BLOCKS = (2, 4, 8, 16)
#: Unit rows of ``Rows.WARP``.
UNIT_ROWS = (16, 32, 64)
#: Tokens per request below which the streamed prep brings the item after next to L2 (at
#: T = 8 its slot-id registers would spill).
PREFETCH_BELOW_T = 8
#: Tokens per request up to which x of the next item is read ahead into registers (at T >= 5
#: the prep warps' registers are full: x is read where it is used, from L2).
X_AHEAD_UP_TO_T = 4
#: The streamed kernel's dynamic shared memory: sm_90's opt-in maximum less the reserve.
STREAM_SMEM_MAX = 232448 - 1024
#: The streamed kernel's prep warpgroup (threads) and padded f_b / f_a rows (bf16 elements:
#: a warp's fragment loads hit 32 banks).
PREP_THREADS = 128
FB_ROW = D + 8
#: Threads a CTA may have.
MAX_THREADS = 1024
#: With ``Prep.GROUP`` the prep warpgroup runs the gate up to 4 items ahead of the groups: 5
#: item slots, which as many consumer groups at most can hold at once (the item-slot protocol
#: of ``tests/backends/cutedsl/test_stream_protocol.py`` races with 6).
GROUP_LAG = 4
GROUP_SLOTS = GROUP_LAG + 1
#: The schedule's yes / no fields.
FLAGS = ("tail", "gate_batch", "state_direct", "split_qk", "early_reads", "stage_fb",
         "prefetch", "x_ahead", "walk", "token_loop", "page_last")
#: Items whose gate projections one ``gate_batch`` MMA pass computes (the MMA's 8 columns).
GATE_BATCH = 8


@dataclasses.dataclass(frozen=True)
class Schedule:
    """How a kernel lays out a step's work (module docstring). Frozen; :meth:`check` says
    whether it can serve a problem. Build one with :func:`make`."""

    rows: Rows
    prep: Prep
    items: Items
    cluster: int = 1
    block: int = 0
    tail: bool = False
    gate_batch: bool = False
    state_direct: bool = False
    split_qk: bool = False
    unit_rows: int = 32
    consumers: int = 8
    depth: int = 1
    early_reads: bool = False
    stage_fb: bool = False
    prefetch: bool = False
    x_ahead: bool = False
    walk: bool = False
    token_loop: bool = False
    page_last: bool = False

    def __post_init__(self):
        object.__setattr__(self, "rows", Rows(self.rows))
        object.__setattr__(self, "prep", Prep(self.prep))
        object.__setattr__(self, "items", Items(self.items))
        why = self._shape_reasons()
        if why:
            raise ValueError(f"Schedule: {'; '.join(why)} (got {self!r})")

    def _shape_reasons(self) -> List[str]:
        """What is inconsistent among the fields alone (any problem)."""
        why = []
        streamed = self.rows == Rows.WARP
        if self.rows == Rows.CTA and (self.prep, self.items) != (Prep.INLINE, Items.ONE):
            why.append("rows=CTA runs with prep=INLINE, items=ONE")
        if self.rows == Rows.CLUSTER:
            if (self.prep, self.items) != (Prep.CLUSTER, Items.ONE):
                why.append("rows=CLUSTER runs with prep=CLUSTER, items=ONE")
            if self.cluster not in CLUSTERS:
                why.append(f"cluster: expected one of {CLUSTERS} with rows=CLUSTER, got "
                           f"{self.cluster}")
        elif self.cluster != 1:
            why.append(f"cluster: expected 1 unless rows=CLUSTER, got {self.cluster}")
        for f in ("cluster", "block", "unit_rows", "consumers", "depth"):
            if type(getattr(self, f)) is not int:
                why.append(f"{f}: expected an int, got {getattr(self, f)!r}")
        for f in FLAGS:
            if type(getattr(self, f)) is not bool:
                why.append(f"{f}: expected a bool, got {getattr(self, f)!r}")
        if why:
            return why
        if not streamed and (self.unit_rows, self.consumers, self.depth) != (32, 8, 1):
            why.append("unit_rows, consumers, depth: the ring of rows=WARP only (leave them "
                       "at 32, 8, 1)")
        if streamed:
            if self.prep not in (Prep.WARPGROUP, Prep.GROUP):
                why.append("rows=WARP runs with prep=WARPGROUP or GROUP")
            if self.items not in (Items.RANGE, Items.BLOCKS):
                why.append("rows=WARP runs with items=RANGE or BLOCKS")
            if self.unit_rows not in UNIT_ROWS:
                why.append(f"unit_rows: expected one of {UNIT_ROWS}, got {self.unit_rows}")
            elif self.consumers <= 0 or self.consumers % (D // self.unit_rows):
                why.append(f"consumers: expected a positive multiple of {D // self.unit_rows} "
                           f"(units per item), got {self.consumers}")
            if self.depth < 1:
                why.append(f"depth: expected >= 1, got {self.depth}")
            if 32 * self.consumers + PREP_THREADS > MAX_THREADS:
                why.append(f"consumers: {self.consumers} warps and the prep warpgroup pass "
                           f"{MAX_THREADS} threads a CTA")
            if self.prep == Prep.GROUP and self.unit_rows == 32 and \
                    self.consumers // self.units > GROUP_SLOTS:
                why.append(f"prep=GROUP runs at most {GROUP_SLOTS} consumer groups (its item "
                           f"slots), got {self.consumers // self.units}")
            if self.prep == Prep.GROUP and (self.items != Items.RANGE or self.unit_rows != 32
                                            or self.early_reads):
                why.append("prep=GROUP runs with items=RANGE, 32-row units (a group's thread "
                           "per channel) and without early_reads")
        else:
            flags = [f for f in ("gate_batch", "early_reads", "stage_fb", "prefetch", "x_ahead",
                                 "walk", "token_loop") if getattr(self, f)]
            if flags:
                why.append(f"{', '.join(flags)}: flags of rows=WARP only")
        if (self.items == Items.BLOCKS) != (self.block != 0):
            why.append(f"block: expected one of {BLOCKS} exactly with items=BLOCKS, got "
                       f"{self.block}")
        elif self.block and self.block not in BLOCKS:
            why.append(f"block: expected one of {BLOCKS}, got {self.block}")
        if self.tail and self.items != Items.BLOCKS:
            why.append("tail: a field of items=BLOCKS only")
        if self.page_last and self.rows != Rows.CTA:
            why.append("page_last: a flag of rows=CTA only")
        if self.state_direct and (self.rows != Rows.CLUSTER or self.cluster < 4):
            why.append(f"state_direct: a flag of rows=CLUSTER with cluster >= 4 (the CTA's rows "
                       f"in one wave of registers), got rows={self.rows.value} cluster="
                       f"{self.cluster}")
        if self.split_qk and self.rows != Rows.CLUSTER:
            why.append(f"split_qk: a flag of rows=CLUSTER, got rows={self.rows.value}")
        return why

    def reasons(self, problem: Problem) -> List[str]:
        """Why this schedule cannot serve ``problem`` (empty: it can)."""
        why = []
        if self.rows == Rows.WARP:
            if self.prep == Prep.GROUP and problem.T != 1:
                why.append(f"prep=GROUP serves T = 1, got T={problem.T}")
            if self.gate_batch and (problem.T != 1 or problem.record):
                why.append(f"gate_batch serves T = 1 without record mode, got T={problem.T}"
                           f"{', record' if problem.record else ''}")
            if self.stage_fb and stream_smem_bytes(problem, self, True) > STREAM_SMEM_MAX:
                why.append(f"stage_fb: the f_b rows do not fit beside the ring and item slots "
                           f"({stream_smem_bytes(problem, self, True)} bytes > "
                           f"{STREAM_SMEM_MAX})")
            if stream_smem_bytes(problem, self, False) > STREAM_SMEM_MAX:
                why.append(f"the ring and item slots need {stream_smem_bytes(problem, self, False)}"
                           f" bytes of shared memory > {STREAM_SMEM_MAX}")
        return why

    def check(self, problem: Problem) -> None:
        """Raise ValueError naming every reason this schedule cannot serve ``problem``."""
        why = self.reasons(problem)
        if why:
            raise ValueError(f"Schedule {self.name} for {problem.tag()}: {'; '.join(why)}")

    # ----------------------------------------------------------------------- derived
    @property
    def units(self) -> int:
        """Units per item (``Rows.WARP``)."""
        return D // self.unit_rows

    @property
    def groups(self) -> int:
        """Consumer groups (``Rows.WARP``): each takes the units of one item at a time."""
        return self.consumers // self.units

    @property
    def stages(self) -> int:
        """The ring's stages (``Rows.WARP``): ``depth`` per consumer warp."""
        return self.consumers * self.depth

    @property
    def lag(self) -> int:
        """Items between an item's prep and its epilogue on the prep warpgroup
        (``Rows.WARP``): one per consumer group, or 4 with ``Prep.GROUP`` (there the prep
        runs the gate up to 4 items ahead of the groups)."""
        return GROUP_LAG if self.prep == Prep.GROUP else self.groups

    @property
    def name(self) -> str:
        """A short name for logs and tools (``wide``, ``split4``, ``stream``, ``streamg``,
        ``stream4``, ``stream4t`` with the tail; ``+gb`` with ``gate_batch``, ``+direct`` with
        ``state_direct``, ``+qk`` with ``split_qk``, ``+early`` where it reads early). Never
        parsed by the backend."""
        if self.rows == Rows.CTA:
            base = "wide"
        elif self.rows == Rows.CLUSTER:
            base = f"split{self.cluster}"
        else:
            base = "stream" + ("g" if self.prep == Prep.GROUP else "") + (
                str(self.block) if self.block else "")
        return (base + ("t" if self.tail else "") + ("+gb" if self.gate_batch else "")
                + ("+direct" if self.state_direct else "") + ("+qk" if self.split_qk else "")
                + ("+early" if self.early_reads else ""))

    def tag(self) -> str:
        """A file-name friendly identifier of every field (part of the compile key)."""
        parts = [self.rows.value, self.prep.value, self.items.value]
        if self.cluster != 1:
            parts.append(f"c{self.cluster}")
        if self.block:
            parts.append(f"b{self.block}")
        if self.tail:
            parts.append("tail")
        if self.rows == Rows.WARP:
            parts += [f"u{self.unit_rows}", f"w{self.consumers}", f"d{self.depth}"]
        for f, short in (("gate_batch", "gb"), ("state_direct", "sd"), ("split_qk", "qk"),
                         ("early_reads", "er"),
                         ("stage_fb", "fb"),
                         ("prefetch", "pf"),
                         ("x_ahead", "xa"), ("walk", "wk"), ("token_loop", "tl"),
                         ("page_last", "pl")):
            if getattr(self, f):
                parts.append(short)
        return "-".join(parts)

    def axes(self) -> dict:
        """The fields a policy table names: the axes, the ring's shape but its depth, and the
        flags the tuner chooses (``tail``, ``gate_batch``, ``state_direct``, ``split_qk``). The
        depth and the other flags come from :func:`make`'s rules (:func:`default_flags`; the
        tuner's candidates keep them), so a table row builds the schedule the tuner timed."""
        out = {"rows": self.rows.value, "prep": self.prep.value, "items": self.items.value}
        for f, default in (("cluster", 1), ("block", 0), ("tail", False), ("gate_batch", False),
                           ("state_direct", False), ("split_qk", False), ("unit_rows", 32),
                           ("consumers", 8)):
            if getattr(self, f) != default:
                out[f] = getattr(self, f)
        return out


def default_flags(problem: Problem, rows: Rows, prep: Prep, items: Items, cluster: int = 1,
                  block: int = 0, unit_rows: int = 32, consumers: int = 8,
                  depth: Optional[int] = None, gate_batch: bool = False) -> dict:
    """The measured defaults of the fields :func:`make` fills in, for ``problem`` and the
    given axes (``docs/design.md`` has the measurements):

    * ``depth``: 2 stages per warp on bf16 pages (a 128 KiB ring either way: 8 x 16 KiB fp32
      units or 16 x 8 KiB bf16 units), else 1;
    * ``prefetch``: below T = :data:`PREFETCH_BELOW_T`; ``x_ahead``: up to T =
      :data:`X_AHEAD_UP_TO_T`;
    * ``walk``: at T = 1 (the prep sets the pace there; at T > 1 splitting each item's index
      measures faster than carrying (request, head) with the slot ids);
    * ``token_loop``: bf16 pages at T > 1 (the unrolled body misses the instruction cache;
      on fp32 pages and at T = 1 it measures faster);
    * ``stage_fb``: where the f_b rows fit beside the ring (of ``depth`` if given), the
      item slots (and with ``gate_batch`` its decays);
    * ``page_last``: the one-CTA kernel always (faster at T = 1-3, equal at T = 5).
    """
    rows, prep = Rows(rows), Prep(prep)
    out = dict(depth=1, prefetch=False, x_ahead=False, walk=False, token_loop=False,
               stage_fb=False, page_last=rows == Rows.CTA)
    if rows == Rows.WARP:
        T = problem.T
        out.update(depth=depth or (2 if problem.state_bf16 else 1),
                   prefetch=T < PREFETCH_BELOW_T,
                   x_ahead=T <= X_AHEAD_UP_TO_T, walk=T == 1,
                   token_loop=problem.state_bf16 and T > 1)
        # (a gate_batch that is no bool is refused with the caller's schedule, not this one)
        probe = Schedule(rows=rows, prep=prep, items=items, cluster=cluster, block=block,
                         unit_rows=unit_rows, consumers=consumers, depth=out["depth"],
                         gate_batch=gate_batch is True)
        out["stage_fb"] = stream_smem_bytes(problem, probe, True) <= STREAM_SMEM_MAX
    return out


def make(problem: Problem, rows, prep, items, **fields) -> Schedule:
    """The schedule with the given axes and fields, every other field from
    :func:`default_flags` for ``problem``. Raises ValueError if it cannot serve it."""
    axes = {k: fields[k] for k in ("cluster", "block", "unit_rows", "consumers", "depth",
                                   "gate_batch") if k in fields}
    merged = default_flags(problem, rows, prep, items, **axes)
    merged.update(fields)
    s = Schedule(rows=rows, prep=prep, items=items, **merged)
    s.check(problem)
    return s


def wide(problem: Problem, **fields) -> Schedule:
    """One CTA per item, inline prep."""
    return make(problem, Rows.CTA, Prep.INLINE, Items.ONE, **fields)


def split(problem: Problem, cluster: int, **fields) -> Schedule:
    """Each item on a cluster of ``cluster`` CTAs."""
    return make(problem, Rows.CLUSTER, Prep.CLUSTER, Items.ONE, cluster=cluster, **fields)


def stream(problem: Problem, prep: Prep = Prep.WARPGROUP, block: int = 0, **fields) -> Schedule:
    """The persistent streamed kernel (``block`` = 0: a range per CTA; C: blocks of C
    requests)."""
    return make(problem, Rows.WARP, prep, Items.BLOCKS if block else Items.RANGE, block=block,
                **fields)


def from_axes(problem: Problem, axes: dict, **fields) -> Schedule:
    """The schedule a policy table's row names (:meth:`Schedule.axes`) for ``problem``."""
    a = dict(axes)
    return make(problem, a.pop("rows"), a.pop("prep"), a.pop("items"), **a, **fields)


# --------------------------------------------------------------------- shared memory
def _struct_bytes(fields) -> int:
    """Bytes of a CuTe DSL struct of ``fields`` = [(bytes, alignment)], laid out in order, each
    at its alignment, the total a multiple of the largest alignment."""
    off, most = 0, 1
    for n, align in fields:
        off = -(-off // align) * align + n
        most = max(most, align)
    return -(-off // most) * most


def stream_smem_bytes(problem: Problem, s: Schedule, with_fb: bool) -> int:
    """The streamed kernel's shared memory for ``problem`` and ``s`` (its storage struct,
    :class:`kda.backends.cutedsl.stream.KdaStream`), with or without the staged f_b rows."""
    T, ni = problem.T, s.lag + 1
    st = 2 if problem.state_bf16 else 4
    stages = s.stages
    fields = [(8 * stages, 8), (stages * s.unit_rows * D * st, 128)]       # ring
    fields += [(3 * 8 * ni, 8)]                                            # ready, done, free
    fields += [(4 * ni * T * D, 16)] * 6                                   # q k a v o og
    fields += [(4 * ni * 8, 16), (4 * ni * 4, 16), (4 * ni * T * 12, 16)]  # beta desc red
    fields += [(16, 8), (2 * 2 * 8 * FB_ROW, 16)]                          # fabar, fa
    if s.prep == Prep.GROUP:
        fields.append((4 * s.groups * 12, 16))                             # gred
    if s.gate_batch:
        fields.append((4 * GATE_BATCH * D, 16))                            # gb
    if with_fb:
        fields += [(8, 8), (2 * D * FB_ROW, 16)]                           # fbbar, fb
    return _struct_bytes(fields)
