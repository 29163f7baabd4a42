"""The synchronization of the CuTe DSL family, in one module: every mbarrier a kernel uses,
who arrives on it, which phase a wait is for, and the named barriers, by role.

A kernel's mbarriers come in :class:`Mbarriers` arrays used *in turn*: the j-th use of an
array (j = 0, 1, ...: an item of a CTA's walk, a unit a warp streams) is barrier ``j % n`` in
its phase ``j // n``, so every waiter passes every phase, a dead item's too. A use is
complete (:meth:`Mbarriers.wait`) once its arrivals (and the bytes its copies announced)
have come; the barrier of use j is free again (:meth:`Mbarriers.wait_free`) once use
``j - n`` is complete. The streamed kernel's pipelines, built from them:

* :class:`StageRing`: a consumer warp's own stages (``depth`` of them); lane 0 announces a
  unit's bytes and issues its bulk copy onto the stage's barrier, the warp waits for them
  (the same warp refills a stage after reading it, so no barrier runs the other way);
* :class:`ItemSlots`: an item slot passes from its prep (*ready*, one arrival per prep
  thread) to its item's consumer warps (*done*, one per lane of each unit warp) to its
  epilogue, which hands it back to the prep (*free*, one arrival per prep thread; with the
  groups' prep the group's lanes prepare and end the item themselves);
* the f_a stages (:data:`FA_STAGES` cp.async arrivals, one per prep thread) and the staged
  f_b rows (one bulk copy).

The split kernel's barriers are used once a launch (:class:`ClusterExchange`).
:class:`Sync` names the named barriers: threads of one role meet at them (``bar.sync``), but
``FIRST_OPS``, where the streamed kernel's prep only arrives (``bar.arrive``, :func:`arrive`)
and its consumers wait.
"""

from __future__ import annotations

import enum

import cutlass
import cutlass.cute as cute
from cutlass.pipeline import NamedBarrier

#: f_a stages of the streamed prep (the item being prepared and the next)
FA_STAGES = 2


class Sync(enum.IntEnum):
    """Named barriers (id 0 is the CTA-wide ``bar.sync``)."""
    PREP = 1          #: the streamed kernel's prep warpgroup
    MAIN = 1          #: the split kernel's main warps
    GROUP = 2         #: consumer group g of the streamed kernel: ``GROUP + g``
    #: the streamed kernel: the prep has requested its first item's operands (its consumers
    #: wait for that before their first page copies)
    FIRST_OPS = 15


def sync(bar, threads: int) -> None:
    """``bar.sync`` on named barrier ``bar`` (a :class:`Sync`, or ``Sync.GROUP + g``) of
    ``threads`` threads (:class:`cutlass.pipeline.NamedBarrier`)."""
    NamedBarrier(int(bar) if isinstance(bar, int) else bar, threads).arrive_and_wait()


def arrive(bar, threads: int) -> None:
    """``bar.arrive`` on named barrier ``bar`` of ``threads`` threads: counts this thread
    without waiting (the others :func:`sync`)."""
    NamedBarrier(int(bar), threads).arrive()


class Mbarriers:
    """``n`` mbarriers from ``base`` (a shared-memory Int64 pointer), used in turn (module
    docstring)."""

    def __init__(self, base, n: int):
        self.base = base
        self.n = n

    # (the DSL carries the object through run-time control flow by its pointer)
    def __extract_mlir_values__(self):
        return [self.base]

    def __new_from_mlir_values__(self, values):
        return Mbarriers(values[0], self.n)

    def at(self, j):
        """The barrier of use ``j`` (a lone barrier is its base: no address arithmetic for
        the compiler to hoist and keep live)."""
        if self.n == 1:
            return self.base
        return self.base + j % self.n

    @staticmethod
    def init(base, n: int, arrivals: int) -> None:
        """Each of the ``n`` barriers from ``base`` expects ``arrivals`` arrivals a phase (one
        thread calls it, before :func:`init_fence`; from the storage's pointer, not an
        object's, so that no barrier address is computed ahead and kept live)."""
        for i in range(n):
            cute.arch.mbarrier_init(base + i, arrivals)

    def wait(self, j) -> None:
        """Until use ``j`` is complete."""
        cute.arch.mbarrier_wait(self.at(j), (j // self.n) & 1)

    def wait_free(self, j) -> None:
        """Until the barrier of use ``j`` is free: its previous use complete."""
        cute.arch.mbarrier_wait(self.at(j), ((j // self.n) & 1) ^ 1)

    def wait_parity(self, j, parity) -> None:
        """Until the phase of parity ``parity`` of the barrier of use ``j`` is complete."""
        cute.arch.mbarrier_wait(self.at(j), parity)

    def arrive(self, j) -> None:
        """This thread's arrival on use ``j``."""
        cute.arch.mbarrier_arrive(self.at(j))

    def arrive_with_bytes(self, j, nbytes: int) -> None:
        """This thread's arrival on use ``j``, announcing the ``nbytes`` its copies bring."""
        cute.arch.mbarrier_arrive_and_expect_tx(self.at(j), nbytes)

    def arrive_on_copies(self, j) -> None:
        """An arrival on use ``j`` once this thread's cp.async copies so far have landed (the
        count of arrivals includes it)."""
        cute.arch.cp_async_mbarrier_arrive_noinc(self.at(j))


def init_fence() -> None:
    """After the barriers' init, before the CTA syncs: the inits visible to the async proxy."""
    cute.arch.mbarrier_init_fence()


def release_reads() -> None:
    """This thread's shared-memory reads ordered before async-proxy writes to the same
    memory (a bulk copy into a stage it read)."""
    cute.arch.fence_proxy("async.shared", space="cta")


class StageRing:
    """A consumer warp's ``depth`` stages: the barriers ``first .. first + depth - 1`` of the
    CTA's stage barriers at ``base`` (warp w's: ``first = w * depth``); unit ``n`` the warp
    streams goes to stage ``first + n % depth`` (the index the warp's stage tensor uses, so
    the compiler keeps one index live, not a second pointer)."""

    def __init__(self, base, depth: int, first):
        self.base = base
        self.depth = depth
        self.first = first

    def __extract_mlir_values__(self):
        return [self.base, self.first]

    def __new_from_mlir_values__(self, values):
        return StageRing(values[0], self.depth, values[1])

    @staticmethod
    def init(base, stages: int) -> None:
        """Every stage's barrier expects one arrival (the copy's issuer, with its bytes)."""
        Mbarriers.init(base, stages, 1)

    def at(self, n):
        """The barrier of unit ``n``'s stage."""
        return self.base + (self.first + n % self.depth)

    def announce(self, n, nbytes: int):
        """Lane 0: unit ``n``'s ``nbytes`` announced on its stage's barrier; returns the
        barrier its bulk copy completes on."""
        bar = self.at(n)
        cute.arch.mbarrier_arrive_and_expect_tx(bar, nbytes)
        return bar

    def wait(self, n) -> None:
        """Until unit ``n`` has landed in its stage."""
        cute.arch.mbarrier_wait(self.at(n), (n // self.depth) & 1)


class ItemSlots:
    """The streamed kernel's ``n`` item slots: item ``j`` of a CTA's walk uses slot ``j % n``
    (module docstring). ``base``: ``3 n`` mbarriers, *ready*, *done* and *free* in turn (one
    pointer carried: a register in the consumers' loop)."""

    def __init__(self, base, n: int):
        self.base = base
        self.ready = Mbarriers(base, n)
        self.done = Mbarriers(base + n, n)
        self.free = Mbarriers(base + 2 * n, n)

    #: mbarriers per slot
    PER_SLOT = 3

    def __extract_mlir_values__(self):
        return [self.base]

    def __new_from_mlir_values__(self, values):
        return ItemSlots(values[0], self.ready.n)

    def init(self, prep: int, consumers: int, freed_by: int) -> None:
        """*ready* expects the ``prep`` threads, *done* the ``consumers`` lanes of an item's
        unit warps, *free* the ``freed_by`` threads of its epilogue (one thread calls it,
        before :func:`init_fence`)."""
        for i in range(self.ready.n):
            cute.arch.mbarrier_init(self.ready.base + i, prep)
            cute.arch.mbarrier_init(self.done.base + i, consumers)
            cute.arch.mbarrier_init(self.free.base + i, freed_by)

    # the prep
    def prep_acquire(self, j) -> None:
        """Until item ``j``'s slot is free (the epilogue of its previous item is done)."""
        self.free.wait_free(j)

    def prep_commit(self, j) -> None:
        """Item ``j``'s slot is filled (this thread's writes released to the consumers)."""
        self.ready.arrive(j)

    # the consumers
    def consumer_wait(self, j) -> None:
        """Until item ``j``'s slot is filled."""
        self.ready.wait(j)

    def consumer_release(self, j) -> None:
        """This lane is done with item ``j``'s slot."""
        self.done.arrive(j)

    # the epilogue
    def epilogue_wait(self, j) -> None:
        """Until every consumer lane of item ``j`` is done."""
        self.done.wait(j)

    def epilogue_release(self, j) -> None:
        """This thread's reads of item ``j``'s slot are done: the slot is free."""
        self.free.arrive(j)


class ClusterExchange:
    """The split kernel's barriers, each used once a launch (phase 0), from ``bars``
    (:meth:`count` mbarriers): the CTA's state rows (one bulk copy), the decays of every
    feature (st.async from every CTA of the cluster), per token t the o of the token's 128 rows
    (st.async to the token's owner, CTA ``t % C``), the gate warp's f_b rows and dt_bias (bulk
    copies), and with ``qk`` (``Schedule.split_qk``) the q / k conv outputs and their warps'
    sums of squares (st.async from every CTA of the cluster)."""

    def __init__(self, bars, T: int, qk: bool = False):
        self.T = T
        self.has_qk = qk
        self.state = bars
        self.alpha = bars + 1
        self.fb = bars + 2 + T
        self.qk = bars + 3 + T if qk else None
        self.bars = bars

    @staticmethod
    def count(T: int, qk: bool) -> int:
        """The mbarriers of ``T`` tokens (with or without the q / k exchange)."""
        return 3 + T + (1 if qk else 0)

    def __extract_mlir_values__(self):
        return [self.bars]

    def __new_from_mlir_values__(self, values):
        return ClusterExchange(values[0], self.T, self.has_qk)

    def o(self, t):
        """The barrier of token ``t``'s o (its owner's)."""
        return self.bars + 2 + t

    @cute.jit
    def init(self, rank, C: int, state_bytes: int, alpha_bytes: int, fb_bytes: int,
             o_bytes: int, qk_bytes: int = 0) -> None:
        """One thread: every barrier expects one arrival, its own, with the bytes that come
        (the state rows, the decays, the f_b rows and dt_bias, the q / k exchange; at the
        owner of token t its o)."""
        T = self.T
        cute.arch.mbarrier_init(self.state, 1)
        cute.arch.mbarrier_init(self.alpha, 1)
        cute.arch.mbarrier_init(self.fb, 1)
        for t in cutlass.range_constexpr(T):
            cute.arch.mbarrier_init(self.o(t), 1)
        if cutlass.const_expr(self.has_qk):
            cute.arch.mbarrier_init(self.qk, 1)
        init_fence()
        cute.arch.mbarrier_arrive_and_expect_tx(self.state, state_bytes)
        cute.arch.mbarrier_arrive_and_expect_tx(self.alpha, alpha_bytes)
        cute.arch.mbarrier_arrive_and_expect_tx(self.fb, fb_bytes)
        if cutlass.const_expr(self.has_qk):
            cute.arch.mbarrier_arrive_and_expect_tx(self.qk, qk_bytes)
        for t in cutlass.range_constexpr(T):
            if rank == t % C:
                cute.arch.mbarrier_arrive_and_expect_tx(self.o(t), o_bytes)

    @staticmethod
    def wait(bar) -> None:
        """Until ``bar``'s bytes have all come."""
        cute.arch.mbarrier_wait(bar, 0)
