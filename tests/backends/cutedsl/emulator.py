"""A lockstep SIMT emulator of the one-CTA-per-item CuTe DSL KDA kernel, for checking it on a CPU.

The wide kernel (``backends/cutedsl/{common,item,wide}.py``) is a Python program that CuTe DSL
traces; every device operation it performs goes through the small instruction vocabulary of
``backends/cutedsl/ptx.py`` or, in the recurrence (``item.py``), a few CuTe tensor operations
(register tensors, fp32 rows in shared memory, ``local_tile``, ``autovec_copy``). This module
loads the *same* kernel sources with stand-ins for CuTe DSL and for that vocabulary, and
executes one CTA at a time with all 256 threads in lockstep: every value is a numpy array
with one lane per thread. So the kernel's index math, liveness, staging layout, schedule (the
state page landing while phase A runs), tensor-core fragment layout, shuffles, barriers and
predication run on the CPU against the PyTorch reference, with checks a GPU would not give:

* every global / shared access is bounds- and alignment-checked (global: against the torch
  storage it falls in; shared: against the CTA's plan);
* a shared-memory read of bytes with a pending ``cp.async`` (not yet waited for) is an error;
* ``bar.sync``, shuffles and ``mma.sync`` with a partially active warp / CTA are errors;
* Int32 arithmetic that leaves the int32 range on an active lane is an error (32-bit offset
  overflow);
* a shared-memory race between the threads of a CTA within one barrier epoch (a byte one
  thread writes, a cp.async included, read or written by another thread with no barrier in
  between, or written after another thread read it), on the staging regions (state page,
  operand rows, window; see ``CTA.check_races``).

What it cannot check: other concurrency (lockstep execution satisfies every barrier; races
on the per-item compute buffers, which the race check does not cover), the compiler, and
approximate transcendentals (numpy computes them exactly). ``mma.sync`` is
emulated as an exact float64 dot product plus C, rounded once.
The split kernel (CuTe tensors and atoms, clusters) is beyond it: it is checked on the GPU.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
import types
from types import SimpleNamespace

import numpy as np
import torch

NT = 256
_I32 = (-(1 << 31), (1 << 31) - 1)


class EmulationError(AssertionError):
    """The kernel did something a GPU would fault on, or that the contract forbids."""


# --------------------------------------------------------------------------------- values
class _State:
    active = [np.ones(NT, bool)]
    cta = None          # the CTA being executed


def _active():
    return _State.active[-1]


@contextlib.contextmanager
def lanes(mask):
    """Execute the body with only ``mask`` lanes active (a divergent branch)."""
    m = _mask_of(mask)
    _State.active.append(_active() & m)
    try:
        yield
    finally:
        _State.active.pop()


def _mask_of(x):
    if isinstance(x, V):
        return x.a.astype(bool) if x.k == "b" else x.a != 0
    return np.full(NT, bool(x))


class V:
    """One value per lane: ``a`` (numpy [256]) and kind ``k`` in i32 / i64 / f32 / b."""

    __slots__ = ("a", "k")

    def __init__(self, a, k):
        if k == "f32":
            a = np.asarray(a, np.float32)
        elif k == "b":
            a = np.asarray(a, bool)
        else:
            a = np.asarray(a, np.int64)
            if k == "i32":
                act = _active()
                if act.any():
                    av = a[act] if a.shape == (NT,) else a
                    if av.size and (av.min() < _I32[0] or av.max() > _I32[1]):
                        raise EmulationError(f"Int32 overflow: {av.min()} .. {av.max()}")
        if a.shape != (NT,):
            a = np.broadcast_to(a, (NT,)).copy()
        self.a, self.k = a, k

    # ---- helpers
    @staticmethod
    def _kind(x, y):
        kx = x.k if isinstance(x, V) else None
        ky = y.k if isinstance(y, V) else None
        if "f32" in (kx, ky) or isinstance(x, float) or isinstance(y, float):
            return "f32"
        if "i64" in (kx, ky):
            return "i64"
        if kx == "b" and ky in (None, "b"):
            return "b"
        return "i32"

    @staticmethod
    def _arr(x):
        return x.a if isinstance(x, V) else x

    def _bin(self, o, fn, rev=False):
        k = V._kind(self, o)
        a, b = (V._arr(o), self.a) if rev else (self.a, V._arr(o))
        if k in ("i32", "i64"):
            a = np.asarray(a, np.int64)
            b = np.asarray(b, np.int64)
        return V(fn(a, b), k)

    def __add__(self, o): return self._bin(o, np.add)
    def __radd__(self, o): return self._bin(o, np.add, True)
    def __sub__(self, o): return self._bin(o, np.subtract)
    def __rsub__(self, o): return self._bin(o, np.subtract, True)
    def __mul__(self, o): return self._bin(o, np.multiply)
    def __rmul__(self, o): return self._bin(o, np.multiply, True)
    def __floordiv__(self, o): return self._bin(o, np.floor_divide)
    def __rfloordiv__(self, o): return self._bin(o, np.floor_divide, True)
    def __mod__(self, o): return self._bin(o, np.mod)
    def __rshift__(self, o): return self._bin(o, np.right_shift)
    def __lshift__(self, o): return self._bin(o, np.left_shift)
    def __and__(self, o): return self._bin(o, np.bitwise_and)
    def __rand__(self, o): return self._bin(o, np.bitwise_and, True)
    def __or__(self, o): return self._bin(o, np.bitwise_or)
    def __ror__(self, o): return self._bin(o, np.bitwise_or, True)
    def __xor__(self, o): return self._bin(o, np.bitwise_xor)
    def __neg__(self): return V(-self.a, self.k)

    def _cmp(self, o, fn):
        return V(fn(self.a, V._arr(o)), "b")

    def __lt__(self, o): return self._cmp(o, np.less)
    def __le__(self, o): return self._cmp(o, np.less_equal)
    def __gt__(self, o): return self._cmp(o, np.greater)
    def __ge__(self, o): return self._cmp(o, np.greater_equal)
    def __eq__(self, o): return self._cmp(o, np.equal)          # noqa: D105
    def __ne__(self, o): return self._cmp(o, np.not_equal)
    __hash__ = None

    def __bool__(self):
        act = _active()
        vals = self.a[act]
        if vals.size == 0:
            raise EmulationError("branch on a value with no active lane")
        if not (vals == vals[0]).all():
            raise EmulationError("a kernel-level branch is not uniform across the CTA")
        return bool(vals[0])

    def __index__(self):
        return int(self.uniform())

    def uniform(self):
        act = _active()
        vals = self.a[act]
        if not (vals == vals[0]).all():
            raise EmulationError("expected a CTA-uniform value")
        return vals[0]


def _v(x, k):
    if isinstance(x, V):
        if x.k == "b":
            return V(x.a.astype(np.int64), k)
        if k == "f32":
            return V(x.a.astype(np.float32), k)
        return V(x.a, k)
    if isinstance(x, (bool, np.bool_)):
        return V(np.full(NT, int(x)), k)
    if k == "f32":
        return V(np.full(NT, x, np.float32), k)
    return V(np.full(NT, int(x)), k)


def Int32(x):  # noqa: N802 - mirrors cutlass.Int32
    """Stand-in for ``cutlass.Int32(x)`` (Booleans become 0/1)."""
    return _v(x, "i32")


def Int64(x):  # noqa: N802
    """Stand-in for ``cutlass.Int64(x)``."""
    return _v(x, "i64")


def Float32(x):  # noqa: N802
    """Stand-in for ``cutlass.Float32(x)``."""
    return _v(x, "f32")


# --------------------------------------------------------------------------------- memory
class Ptr:
    """A global pointer per lane: byte addresses ``addr`` (int64 [256]) and element size."""

    def __init__(self, addr, esize):
        self.addr = np.broadcast_to(np.asarray(addr, np.int64), (NT,)).copy()
        self.esize = esize

    def __add__(self, off):
        o = V._arr(off) if isinstance(off, V) else off
        return Ptr(self.addr + np.asarray(o, np.int64) * self.esize, self.esize)

    def toint(self):
        return V(self.addr, "i64")


class GlobalMemory:
    """Fake device memory backed by the torch storages of a case (writes go to the tensors)."""

    def __init__(self):
        self.bases, self.bufs, self.names = [], [], []
        self._next = 1 << 40

    def register(self, t: torch.Tensor, name: str):
        """Map ``t``'s storage (once) and return the fake address of ``t``'s first element."""
        st = t.untyped_storage()
        for b, buf, n in zip(self.bases, self.bufs, self.names):
            if buf.ctypes.data == st.data_ptr():
                return b + t.storage_offset() * t.element_size()
        raw = torch.empty(0, dtype=torch.uint8).set_(st).numpy()
        base = self._next
        self._next += (st.nbytes() + (1 << 20)) // 4096 * 4096 + 4096
        self.bases.append(base)
        self.bufs.append(raw)
        self.names.append(name)
        return base + t.storage_offset() * t.element_size()

    def _locate(self, addr, size, mask, what):
        out_buf = np.full(NT, -1)
        for i, (b, buf) in enumerate(zip(self.bases, self.bufs)):
            inside = (addr >= b) & (addr + size <= b + buf.size)
            out_buf[inside] = i
        bad = mask & (out_buf < 0)
        if bad.any():
            lane = int(np.nonzero(bad)[0][0])
            near = [(n, int(addr[lane] - b)) for n, b in zip(self.names, self.bases)
                    if 0 <= addr[lane] - b < (1 << 36)]
            raise EmulationError(f"{what}: out-of-bounds global access at lane {lane} "
                                 f"(buffer, offset) = {near}")
        if (mask & (addr % size != 0)).any():
            raise EmulationError(f"{what}: misaligned {size}-byte global access")
        return out_buf

    def load(self, ptr: Ptr, size: int, mask, what):
        """``size`` bytes per active lane in ``mask`` (bounds and alignment checked)."""
        mask = mask & _active()
        out = np.zeros((NT, size), np.uint8)
        if not mask.any():
            return out
        which = self._locate(ptr.addr, size, mask, what)
        for i in np.unique(which[mask]):
            sel = mask & (which == i)
            off = ptr.addr[sel] - self.bases[i]
            idx = off[:, None] + np.arange(size)[None, :]
            out[sel] = self.bufs[i][idx]
        return out

    def store(self, ptr: Ptr, data: np.ndarray, mask, what):
        """Write ``data`` [256, size] bytes for the active lanes in ``mask``."""
        mask = mask & _active()
        if not mask.any():
            return
        size = data.shape[1]
        which = self._locate(ptr.addr, size, mask, what)
        for i in np.unique(which[mask]):
            sel = mask & (which == i)
            off = ptr.addr[sel] - self.bases[i]
            idx = off[:, None] + np.arange(size)[None, :]
            self.bufs[i][idx] = data[sel]


class CTA:
    """One CTA's shared memory, pending cp.async copies and block index."""

    def __init__(self, block, smem_bytes, gmem):
        self.block = block
        self.smem = np.full(smem_bytes, 0xFF, np.uint8)      # NaN-ish garbage
        self.pending = np.zeros(smem_bytes, bool)
        self.queue = []          # issued, not yet committed
        self.groups = []         # committed groups, oldest first
        self.gmem = gmem
        self.barriers = 0        # also the barrier epoch of the race check
        # Race check (see _note_read / _note_write): per shared byte, the thread that last
        # wrote it (a cp.async: when it completed) and in which epoch, and who read it in
        # which epoch (-2: several threads).
        self.w_thread = np.full(smem_bytes, -1, np.int32)
        self.w_epoch = np.full(smem_bytes, -1, np.int64)
        self.r_thread = np.full(smem_bytes, -1, np.int32)
        self.r_epoch = np.full(smem_bytes, -1, np.int64)
        self.checked = np.zeros(smem_bytes, bool)   # bytes the race check covers (check_races)

    def check_races(self, start, end):
        """Cover shared bytes [start, end) by the race check."""
        self.checked[start:end] = True

    # Race check, on the bytes given to check_races (run() gives the staging regions: the state
    # page, the operand rows and window; not the per-item compute buffers, where the
    # epilogue's loads for tokens t >= T read past CO into neighbouring buffers and discard
    # the values, which this check cannot tell from a racing read).
    # Between two CTA barriers (one epoch) the threads of a CTA run in any order on a GPU, so
    # a shared byte that one thread writes may not be read or written by another thread in the
    # same epoch, nor written after another thread read it in that epoch. A cp.async counts
    # as a write from its issue (other threads' earlier reads in the epoch race with it) and
    # lands for its issuing thread when that thread waits for it; other threads see it only
    # after the next barrier. The lockstep execution would hide all of these, so they are
    # checked here instead.
    def _checked(self, idx, lanes):
        """(bytes, lanes) of an access ([n, size] byte indices by n lanes), flattened and kept
        to the bytes the race check covers."""
        b, l = idx.ravel(), np.repeat(lanes, idx.shape[1])
        keep = self.checked[b]
        return b[keep], l[keep]

    def _race(self, what, kind, b, l, other):
        i = int(np.argmax(kind))
        raise EmulationError(f"{what}: shared-memory race at byte {int(b[i])}: thread {int(l[i])} "
                             f"against thread {int(other[i])} (-2: several) in the same barrier "
                             f"epoch {self.barriers}")

    def _note_read(self, idx, lanes, what):
        b, l = self._checked(idx, lanes)
        if not b.size:
            return
        wt = self.w_thread[b]
        raw = (self.w_epoch[b] == self.barriers) & (wt >= 0) & (wt != l)
        if raw.any():
            self._race(what + " (read after another thread's write)", raw, b, l, wt)
        order = np.argsort(b, kind="stable")
        bs, ls = b[order], l[order]
        ub, start = np.unique(bs, return_index=True)
        lo = np.minimum.reduceat(ls, start)
        hi = np.maximum.reduceat(ls, start)
        new = np.where(lo == hi, lo, -2)
        same = self.r_epoch[ub] == self.barriers
        self.r_thread[ub] = np.where(same & (self.r_thread[ub] != new), -2, new)
        self.r_epoch[ub] = self.barriers

    def _note_write(self, idx, lanes, what, complete):
        b, l = self._checked(idx, lanes)
        if not b.size:
            return
        rt = self.r_thread[b]
        war = (self.r_epoch[b] == self.barriers) & (rt != -1) & (rt != l)
        if war.any():
            self._race(what + " (write after another thread's read)", war, b, l, rt)
        wt = self.w_thread[b]
        waw = (self.w_epoch[b] == self.barriers) & (wt >= 0) & (wt != l)
        if waw.any():
            self._race(what + " (write after another thread's write)", waw, b, l, wt)
        if len(np.unique(b)) != len(b):
            raise EmulationError(f"{what}: several threads write one shared byte at once")
        if complete:
            self.w_thread[b] = l
            self.w_epoch[b] = self.barriers

    def _check(self, addr, size, mask, what):
        if (mask & ((addr < 0) | (addr + size > self.smem.size))).any():
            raise EmulationError(f"{what}: out-of-bounds shared access "
                                 f"{addr[mask].min()}..{addr[mask].max()} / {self.smem.size}")
        if (mask & (addr % size != 0)).any():
            raise EmulationError(f"{what}: misaligned {size}-byte shared access")

    def sload(self, addr, size, mask, what):
        mask = mask & _active()
        addr = np.asarray(addr, np.int64)
        out = np.zeros((NT, size), np.uint8)
        if not mask.any():
            return out
        self._check(addr, size, mask, what)
        idx = addr[mask][:, None] + np.arange(size)[None, :]
        if self.pending[idx].any():
            raise EmulationError(f"{what}: shared read of bytes whose cp.async was not waited for")
        self._note_read(idx, np.nonzero(mask)[0], what)
        out[mask] = self.smem[idx]
        return out

    def sstore(self, addr, data, mask, what):
        mask = mask & _active()
        addr = np.asarray(addr, np.int64)
        if not mask.any():
            return
        size = data.shape[1]
        self._check(addr, size, mask, what)
        idx = addr[mask][:, None] + np.arange(size)[None, :]
        if self.pending[idx].any():
            raise EmulationError(f"{what}: shared write over a pending cp.async")
        self._note_write(idx, np.nonzero(mask)[0], what, complete=True)
        self.smem[idx] = data[mask]

    def cp_async(self, saddr, gptr, nbytes, mask):
        mask = mask & _active()
        saddr = np.asarray(saddr, np.int64)
        if not mask.any():
            return
        self._check(saddr, nbytes, mask, "cp.async")
        data = self.gmem.load(gptr, nbytes, mask, "cp.async source")
        idx = saddr[mask][:, None] + np.arange(nbytes)[None, :]
        if self.pending[idx].any():
            raise EmulationError("cp.async over a pending cp.async")
        lanes = np.nonzero(mask)[0]
        self._note_write(idx, lanes, "cp.async", complete=False)
        self.pending[idx] = True
        self.queue.append((idx, data[mask], lanes))

    def commit(self):
        self.groups.append(self.queue)
        self.queue = []

    def wait_group(self, n):
        """Complete all but the n most recently committed groups (uncommitted copies stay)."""
        while len(self.groups) > n:
            for idx, data, lanes in self.groups.pop(0):
                self.smem[idx] = data
                self.pending[idx] = False
                b, l = self._checked(idx, lanes)  # visible to its issuing thread from now on
                self.w_thread[b] = l
                self.w_epoch[b] = self.barriers

    def wait_all(self):
        """cp.async.wait_all = commit_group + wait_group 0."""
        self.commit()
        self.wait_group(0)


def _bytes_to(data, dtype):
    return np.ascontiguousarray(data).view(dtype)


def _from(vals, dtype):
    return np.ascontiguousarray(np.asarray(vals, dtype).reshape(NT, -1)).view(np.uint8)


# ------------------------------------------------------------------------- the vocabulary
class _P(types.ModuleType):
    """Stand-in for ``kda.backends.cutedsl.ptx`` (same function names and semantics)."""


P = _P("kda.backends.cutedsl.ptx")


def _pm(pred):
    return np.ones(NT, bool) if pred is None else _mask_of(pred)


def _reg(name):
    def deco(fn):
        setattr(P, name, fn)
        return fn
    return deco


def _cta():
    return _State.cta


def _saddr(a):
    return V._arr(a) if isinstance(a, V) else np.full(NT, a)


@_reg("sld_f32")
def _sld_f32(addr):
    return V(_bytes_to(_cta().sload(_saddr(addr), 4, np.ones(NT, bool), "ld.shared.f32"), np.float32)[:, 0], "f32")


@_reg("sld_v4")
def _sld_v4(addr):
    d = _bytes_to(_cta().sload(_saddr(addr), 16, np.ones(NT, bool), "ld.shared.v4"), np.float32)
    return tuple(V(d[:, i], "f32") for i in range(4))


@_reg("sld_bf16x4")
def _sld_bf16x4(addr):
    d = _bytes_to(_cta().sload(_saddr(addr), 8, np.ones(NT, bool), "ld.shared.v2.b32"), np.uint16)
    return tuple(V((d[:, i].astype(np.uint32) << np.uint32(16)).view(np.float32), "f32")
                 for i in range(4))


@_reg("sld_b32")
def _sld_b32(addr):
    return V(_bytes_to(_cta().sload(_saddr(addr), 4, np.ones(NT, bool), "ld.shared.b32"), np.int32)[:, 0], "i32")


@_reg("sld_u16")
def _sld_u16(addr):
    return V(_bytes_to(_cta().sload(_saddr(addr), 2, np.ones(NT, bool), "ld.shared.u16"), np.uint16)[:, 0], "i32")


@_reg("sst_f32")
def _sst_f32(addr, v, pred=None):
    _cta().sstore(_saddr(addr), _from(Float32(v).a, np.float32), _pm(pred), "st.shared.f32")


@_reg("sst_b32")
def _sst_b32(addr, v, pred=None):
    _cta().sstore(_saddr(addr), _from((Int32(v).a & 0xFFFFFFFF).astype(np.uint32), np.uint32),
                  _pm(pred), "st.shared.b32")


@_reg("cp_async16")
def _cp_async16(saddr, gptr, pred):
    _cta().cp_async(_saddr(saddr), gptr, 16, _pm(pred))


@_reg("cp_async_ca")
def _cp_async_ca(saddr, gptr, nbytes, pred):
    if nbytes not in (4, 8):
        raise EmulationError(f"cp.async.ca of {nbytes} bytes (4 or 8 only)")
    _cta().cp_async(_saddr(saddr), gptr, nbytes, _pm(pred))


@_reg("sst_v2_b32")
def _sst_v2_b32(addr, a, b, pred):
    words = np.stack([(Int32(w).a & 0xFFFFFFFF).astype(np.uint32) for w in (a, b)], 1)
    _cta().sstore(_saddr(addr), _from(words, np.uint32), _pm(pred), "st.shared.v2.b32")


@_reg("cp_async16_multi")
def _cp_async16_multi(sbase, gbase, offsets, pred):
    for so, go in offsets:
        _cta().cp_async(_saddr(sbase) + so, Ptr(gbase.addr + go, 1), 16, _pm(pred))


@_reg("cp_async8_multi")
def _cp_async8_multi(sbase, gbase, offsets, pred):
    for so, go in offsets:
        _cta().cp_async(_saddr(sbase) + so, Ptr(gbase.addr + go, 1), 8, _pm(pred))


@_reg("cp_async_commit")
def _commit():
    if not _active().all():
        raise EmulationError("cp.async.commit_group emulated only CTA-wide")
    _cta().commit()


@_reg("cp_async_wait_group")
def _wait_group(n):
    if not _active().all():
        raise EmulationError("cp.async.wait_group emulated only CTA-wide")
    _cta().wait_group(n)


@_reg("cp_async_wait_all")
def _wait_all():
    if not _active().all():
        raise EmulationError("cp.async.wait_all emulated only CTA-wide")
    _cta().wait_all()


def _gload(gptr, size, pred, what):
    m = _pm(pred)
    return _cta().gmem.load(gptr, size, m, what), m


@_reg("gld_nc_b32")
def _gld_nc_b32(gptr):
    d, _ = _gload(gptr, 4, None, "ld.global.nc.b32")
    return V(_bytes_to(d, np.int32)[:, 0], "i32")


@_reg("gld_nc_b32_or0")
def _gld_nc_b32_or0(gptr, pred):
    d, m = _gload(gptr, 4, pred, "ld.global.nc.b32")
    return V(np.where(m, _bytes_to(d, np.int32)[:, 0], 0), "i32")


@_reg("gld_nc_u16")
def _gld_nc_u16(gptr):
    d, _ = _gload(gptr, 2, None, "ld.global.nc.u16")
    return V(_bytes_to(d, np.uint16)[:, 0], "i32")


@_reg("gld_nc_u16_or0")
def _gld_nc_u16_or0(gptr, pred):
    d, m = _gload(gptr, 2, pred, "ld.global.nc.u16")
    return V(np.where(m, _bytes_to(d, np.uint16)[:, 0], 0), "i32")


@_reg("gld_nc_u16x2_or0")
def _gld_nc_u16x2_or0(gptr, pred):
    lo, m = _gload(gptr, 2, pred, "ld.global.nc.b16")
    hi, _ = _gload(Ptr(gptr.addr + 2, 1), 2, pred, "ld.global.nc.b16")
    w = _bytes_to(lo, np.uint16)[:, 0].astype(np.uint32) | (
        _bytes_to(hi, np.uint16)[:, 0].astype(np.uint32) << np.uint32(16))
    return V(np.where(m, w.view(np.int32), 0), "i32")


@_reg("gld_nc_f32")
def _gld_nc_f32(gptr):
    d, _ = _gload(gptr, 4, None, "ld.global.nc.f32")
    return V(_bytes_to(d, np.float32)[:, 0], "f32")


@_reg("gld_nc_f32_or0")
def _gld_nc_f32_or0(gptr, pred):
    d, m = _gload(gptr, 4, pred, "ld.global.nc.f32")
    return V(np.where(m, _bytes_to(d, np.float32)[:, 0], 0), "f32")


@_reg("gld_cg_u16_or0")
def _gld_cg_u16_or0(gptr, pred):
    d, m = _gload(gptr, 2, pred, "ld.global.cg.u16")
    return V(np.where(m, _bytes_to(d, np.uint16)[:, 0], 0), "i32")


@_reg("gld_cg_b32_or0")
def _gld_cg_b32_or0(gptr, pred):
    d, m = _gload(gptr, 4, pred, "ld.global.cg.b32")
    return V(np.where(m, _bytes_to(d, np.int32)[:, 0], 0), "i32")


def _gstore(gptr, data, pred, what):
    _cta().gmem.store(gptr, data, _pm(pred), what)


@_reg("gst_b16")
def _gst_b16(gptr, v, pred):
    _gstore(gptr, _from((Int32(v).a & 0xFFFF).astype(np.uint16), np.uint16), pred, "st.global.b16")


@_reg("gst_b32")
def _gst_b32(gptr, v, pred):
    _gstore(gptr, _from((Int32(v).a.astype(np.int64) & 0xFFFFFFFF).astype(np.uint32), np.uint32), pred,
            "st.global.b32")


@_reg("gst_f32")
def _gst_f32(gptr, v, pred):
    _gstore(gptr, _from(Float32(v).a, np.float32), pred, "st.global.f32")


@_reg("gst_v4_f32")
def _gst_v4_f32(gptr, a, b, c, d, pred):
    vals = np.stack([Float32(x).a for x in (a, b, c, d)], 1)
    _gstore(gptr, _from(vals, np.float32), pred, "st.global.v4.f32")


@_reg("gst_v4_f32_off")
def _gst_v4_f32_off(gptr, off, a, b, c, d, pred):
    _gst_v4_f32(Ptr(gptr.addr + off, 1), a, b, c, d, pred)


@_reg("gst_bf16x4_off")
def _gst_bf16x4_off(gptr, off, a, b, c, d, pred):
    vals = np.stack([_bf16(Float32(x).a).view(torch.int16).numpy() for x in (a, b, c, d)], 1)
    _gstore(Ptr(gptr.addr + off, 1), _from(vals, np.int16), pred, "st.global.v2.b32")


@_reg("gst_v4_zero")
def _gst_v4_zero(gptr, pred):
    _gstore(gptr, np.zeros((NT, 16), np.uint8), pred, "st.global.v4.b32")


# ---- arithmetic
def _f(x):
    return Float32(x).a.astype(np.float64)


@_reg("fmul")
def _fmul(a, b):
    return V((Float32(a).a * Float32(b).a).astype(np.float32), "f32")


@_reg("fadd")
def _fadd(a, b):
    return V((Float32(a).a + Float32(b).a).astype(np.float32), "f32")


@_reg("fsub")
def _fsub(a, b):
    return V((Float32(a).a - Float32(b).a).astype(np.float32), "f32")


@_reg("ffma")
def _ffma(a, b, c):
    return V((_f(a) * _f(b) + _f(c)).astype(np.float32), "f32")


@_reg("fexp")
def _fexp(x):
    with np.errstate(over="ignore"):
        return V(np.exp(_f(x)).astype(np.float32), "f32")


@_reg("rsqrt")
def _rsqrt(x):
    with np.errstate(divide="ignore"):
        return V((1.0 / np.sqrt(_f(x))).astype(np.float32), "f32")


@_reg("sigmoid")
def _sigmoid(x):
    with np.errstate(over="ignore"):
        return V((1.0 / (1.0 + np.exp(-_f(x)))).astype(np.float32), "f32")


@_reg("softplus")
def _softplus(x):
    xf = _f(x)
    with np.errstate(over="ignore"):
        return V(np.where(xf > 20.0, xf, np.log1p(np.exp(xf))).astype(np.float32), "f32")


@_reg("bf16_bits_to_f32")
def _bf16_to_f32(bits):
    b = (Int32(bits).a & 0xFFFF).astype(np.uint32) << np.uint32(16)
    return V(b.view(np.float32), "f32")


@_reg("f32_bits")
def _f32_bits(x):
    return V(Float32(x).a.view(np.int32).astype(np.int64), "i32")


@_reg("f32_from_bits")
def _f32_from_bits(bits):
    return V((Int32(bits).a.astype(np.int64) & 0xFFFFFFFF).astype(np.uint32).view(np.float32), "f32")


def _bf16(xf32):
    return torch.from_numpy(np.asarray(xf32, np.float32).copy()).to(torch.bfloat16)


@_reg("bf16_round")
def _bf16_round(x):
    return V(_bf16(Float32(x).a).to(torch.float32).numpy(), "f32")


@_reg("bf16_bits")
def _bf16_bits(x):
    return V(_bf16(Float32(x).a).view(torch.int16).numpy().astype(np.int64) & 0xFFFF, "i32")


def _full_warps(what):
    act = _active().reshape(8, 32)
    if not (act.all(1) | ~act.any(1)).all():
        raise EmulationError(f"{what} with a partially active warp")
    return act.all(1)


@_reg("shfl_xor")
def _shfl_xor(x, m):
    _full_warps("shfl.sync")
    src = np.arange(NT) ^ int(m)
    return V(Float32(x).a[src], "f32")


@_reg("warp_sum")
def _warp_sum(x):
    for m in (16, 8, 4, 2, 1):
        x = _fadd(x, _shfl_xor(x, m))
    return x


@_reg("row_sum8")
def _row_sum8(acc):
    x = _fadd(acc[0], acc[1])
    for m in (1, 2, 4):
        x = _fadd(x, _shfl_xor(x, m))
    return x


@_reg("sel_i32")
def _sel_i32(pred, a, b):
    return V(np.where(_mask_of(pred), Int32(a).a, Int32(b).a), "i32")


@_reg("clamp_i32")
def _clamp_i32(x, lo, hi):
    return V(np.minimum(np.maximum(Int32(x).a, lo), hi), "i32")


@_reg("live_flag")
def _live_flag(src, cslot, slots, valid):
    s, c, n = Int32(src).a, Int32(cslot).a, Int32(slots).a
    ok = _mask_of(valid) & (s > 0) & (s < n) & (c > 0) & (c < n)
    return V(ok.astype(np.int64), "i32")


def _unpack_bf16(reg):
    r = Int32(reg).a.astype(np.int64) & 0xFFFFFFFF
    lo = ((r & 0xFFFF).astype(np.uint32) << np.uint32(16)).view(np.float32)
    hi = (((r >> 16) & 0xFFFF).astype(np.uint32) << np.uint32(16)).view(np.float32)
    return lo.astype(np.float64), hi.astype(np.float64)


@_reg("mma_bf16")
def _mma(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
    """mma.sync.m16n8k16.row.col f32.bf16.bf16.f32 per warp (PTX ISA fragment layouts)."""
    warps = _full_warps("mma.sync")
    lane = np.arange(32)
    g, tig = lane >> 2, lane & 3
    outs = [np.zeros(NT, np.float32) for _ in range(4)]
    for w in np.nonzero(warps)[0]:
        sl = slice(32 * w, 32 * w + 32)
        A = np.zeros((16, 16))
        B = np.zeros((16, 8))
        C = np.zeros((16, 8))
        for reg, (ro, co) in zip((a0, a1, a2, a3), ((0, 0), (8, 0), (0, 8), (8, 8))):
            lo, hi = _unpack_bf16(reg)
            A[g + ro, 2 * tig + co] = lo[sl]
            A[g + ro, 2 * tig + co + 1] = hi[sl]
        for reg, ko in zip((b0, b1), (0, 8)):
            lo, hi = _unpack_bf16(Int32(reg))
            B[2 * tig + ko, g] = lo[sl]
            B[2 * tig + ko + 1, g] = hi[sl]
        for reg, (ro, co) in zip((c0, c1, c2, c3), ((0, 0), (0, 1), (8, 0), (8, 1))):
            C[g + ro, 2 * tig + co] = Float32(reg).a[sl]
        Dm = (A @ B + C).astype(np.float32)
        for i, (ro, co) in enumerate(((0, 0), (0, 1), (8, 0), (8, 1))):
            outs[i][sl] = Dm[g + ro, 2 * tig + co]
    return tuple(V(o, "f32") for o in outs)


@_reg("bar_sync")
def _bar_sync():
    if not _active().all():
        raise EmulationError("bar.sync in a divergent region")
    _cta().barriers += 1


for _name in ("fence_gpu", "griddep_wait", "griddep_launch"):
    setattr(P, _name, lambda: None)


# ------------------------------------------------------------------- CuTe DSL stand-ins
class _Rmem:
    """A register tensor of a compact row-major shape (``make_rmem_tensor``): one value per
    lane per element; an element index is an int or a tuple of ints."""

    def __init__(self, shape, kind):
        self.shape = tuple(shape)
        self.v = [V(np.zeros(NT), kind) for _ in range(int(np.prod(self.shape)))]
        self.kind = kind

    def _flat(self, i):
        if isinstance(i, tuple):
            f = 0
            for x, n in zip(i, self.shape):
                f = f * n + x
            return f
        return i

    def __getitem__(self, i):
        return self.v[self._flat(i)]

    def __setitem__(self, i, x):
        x = _v(x, self.kind)
        act = _active()
        f = self._flat(i)
        self.v[f] = V(np.where(act, x.a, self.v[f].a), self.kind)


class _SmemF32:
    """A 1-D fp32 tensor in shared memory at byte address ``addr`` (a value per lane): what
    ``make_tensor(make_ptr(Float32, addr, smem), layout)`` and ``local_tile`` of it give."""

    def __init__(self, addr):
        self.addr = addr


def _make_ptr(dtype, addr, space, assumed_align=None):
    if dtype is not Float32 or space != "smem":
        raise EmulationError("the emulator's make_ptr covers fp32 shared-memory pointers only")
    return _SmemF32(addr)


def _local_tile(t, tiler, coord):
    if not isinstance(t, _SmemF32) or len(tiler) != 1:
        raise EmulationError("the emulator's local_tile covers 1-D shared-memory tensors only")
    return _SmemF32(t.addr + coord[0] * (4 * tiler[0]))


def _autovec_copy(src, dst):
    if not isinstance(src, _SmemF32) or not isinstance(dst, _Rmem) or dst.shape != (4,):
        raise EmulationError("the emulator's autovec_copy covers 4 fp32 shared -> registers")
    for i, x in enumerate(_sld_v4(src.addr)):
        dst[i] = x


def _make_fake_modules():
    cutlass = types.ModuleType("cutlass")
    cute = types.ModuleType("cutlass.cute")
    memory = types.ModuleType("cutlass.memory")
    cuda = types.ModuleType("cuda")
    bindings = types.ModuleType("cuda.bindings")
    driver = types.ModuleType("cuda.bindings.driver")

    cutlass.Int32, cutlass.Int64, cutlass.Float32 = Int32, Int64, Float32
    cutlass.BFloat16 = None     # imported by item.py for bf16 stores, which wide does not use
    cutlass.range_constexpr = range
    cutlass.const_expr = lambda x: x
    cutlass.cute = cute
    cute.kernel = lambda f: f
    cute.jit = lambda f: f
    cute.Pointer = Ptr
    cute.Tensor = object
    def make_layout(shape, stride=None):
        shape = shape if isinstance(shape, tuple) else (shape,)
        compact = tuple(int(np.prod(shape[i + 1:])) for i in range(len(shape)))
        if (len(shape) > 1 or stride is not None) and tuple(stride or ()) != compact:
            raise EmulationError(f"the emulator's layouts are 1-D or row-major with the strides "
                                 f"given: {shape}:{stride}")
        return shape

    cute.make_layout = make_layout
    cute.make_rmem_tensor = lambda shape, dtype: _Rmem(shape, {Int32: "i32", Int64: "i64",
                                                              Float32: "f32"}[dtype])
    cute.size = lambda t, mode: t.shape[mode[0]]
    cute.AddressSpace = SimpleNamespace(smem="smem")
    cute.make_ptr = _make_ptr
    cute.make_tensor = lambda ptr, layout: ptr
    cute.local_tile = _local_tile
    cute.autovec_copy = _autovec_copy
    cute.arch = SimpleNamespace(
        thread_idx=lambda: (V(np.arange(NT), "i32"), 0, 0),
        block_idx=lambda: (V(np.full(NT, _State.cta.block), "i32"), 0, 0))

    class SmemAllocator:
        def allocate(self, nbytes, byte_alignment=1):
            return SimpleNamespace(toint=lambda: V(np.zeros(NT), "i32"))

    memory.SmemAllocator = SmemAllocator
    driver.CUstream = int
    cuda.bindings = bindings
    bindings.driver = driver
    return {"cutlass": cutlass, "cutlass.cute": cute, "cutlass.memory": memory, "cuda": cuda,
            "cuda.bindings": bindings, "cuda.bindings.driver": driver}


_HERE = os.path.dirname(os.path.abspath(__file__))
_SRC = os.path.normpath(os.path.join(_HERE, "..", "..", "..", "backends", "cutedsl"))
_loaded = None


def load_kernels():
    """The wide kernel's modules (args, item, common, wide) loaded against the emulator."""
    global _loaded
    if _loaded is not None:
        return _loaded
    import kda.backends.cutedsl as pkg

    fakes = _make_fake_modules()
    # (the scheduler, which wide imports, is loaded against the fakes too and forgotten
    # after: the real one stays the process's)
    names = list(fakes) + ["kda.backends.cutedsl.ptx", "kda.backends.cutedsl.args",
                           "kda.backends.cutedsl.item", "kda.backends.cutedsl.common",
                           "kda.backends.cutedsl.wide", "kda.backends.cutedsl.scheduler"]
    saved_mods = {n: sys.modules.get(n) for n in names}
    saved_attrs = {n: getattr(pkg, n, None) for n in ("ptx", "args", "item", "common", "wide",
                                                      "scheduler")}
    mods = {}
    try:
        sys.modules.update(fakes)
        sys.modules["kda.backends.cutedsl.ptx"] = P
        pkg.ptx = P
        for name in ("args", "item", "common", "wide"):
            spec = importlib.util.spec_from_file_location(f"kda.backends.cutedsl.{name}",
                                                          os.path.join(_SRC, f"{name}.py"))
            mod = importlib.util.module_from_spec(spec)
            sys.modules[f"kda.backends.cutedsl.{name}"] = mod
            setattr(pkg, name, mod)
            spec.loader.exec_module(mod)
            mods[name] = mod
    finally:
        for n, m in saved_mods.items():
            if m is None:
                sys.modules.pop(n, None)
            else:
                sys.modules[n] = m
        for n, a in saved_attrs.items():
            if a is None:
                if hasattr(pkg, n):
                    delattr(pkg, n)
            else:
                setattr(pkg, n, a)

    # the two divergent branches of phase A (the only non-uniform `if`s) run under lane masks
    item_math = mods["common"].ItemMath

    def _phase_a_conv(self, p, desc, wreg, hp):
        with lanes(p.tid < 128):
            self._conv_qk(p, desc, wreg, hp)
        with lanes(p.tid >= 128):
            self._conv_v(p, desc, wreg, hp)

    def _phase_a_norm(self, p):
        with lanes(p.tid < 128):
            self._norm(p)

    item_math._phase_a_conv = _phase_a_conv
    item_math._phase_a_norm = _phase_a_norm
    _loaded = mods
    return mods


# ------------------------------------------------------------------------------ the runner
_ESIZE = {torch.bfloat16: 2, torch.float32: 4, torch.int32: 4}


def run(cfg, args, page_last: bool = None, row_bytes: int = None) -> dict:
    """Run the wide kernel on the CPU tensors ``args`` in place (one CTA per item, in order).

    Args:
      page_last: the item's page committed as its own cp.async group (default: the
        one-CTA schedule's, :func:`kda.backends.cutedsl.schedule.wide`).
      row_bytes: the build's row alignment (default: the rows', as the launcher picks it,
        :func:`kda.backend.row_bytes`); a wider one than the rows have faults as on a GPU.

    Returns:
      {"ctas": n, "barriers": total barriers executed}.
    """
    from kda.backends.cutedsl import schedule as S
    from kda.backends.cutedsl.problem import Problem
    from kda.backends.cutedsl.static import SmemPlan

    from kda.backend import row_bytes as rows_of

    mods = load_kernels()
    if row_bytes is None:
        row_bytes = rows_of(args)
    pb = Problem.from_config(cfg, row_bytes=row_bytes)
    sched = S.wide(pb) if page_last is None else S.wide(pb, page_last=page_last)
    obj = mods["wide"].KdaWide(pb, sched)
    gmem = GlobalMemory()
    ptrs = []
    # the kernel takes the tensors in the record's field order (args.OPERANDS)
    for name, t in zip(mods["args"].OPERANDS, args):
        if t is None:
            ptrs.append(Ptr(gmem.register(args.x, "x"), 2))
        else:
            ptrs.append(Ptr(gmem.register(t, name), _ESIZE[t.dtype]))
    R = args.state_indices.shape[0]
    H = cfg.num_heads
    lb = cfg.lower_bound if cfg.lower_bound is not None else 0.0
    scalars = [Int32(R), Int32(args.state.shape[0]), Int32(args.x.stride(0)),
               Int32(args.f_a.stride(0)), Int32(args.beta.stride(0)),
               Int32(args.output_gate.stride(0)), Int32(args.out.stride(0)),
               Int64(args.state.stride(0)), Int64(args.conv_state.stride(0)),
               Float32(cfg.scale), Float32(cfg.norm_eps), Float32(lb)]
    grid = R * H
    plan = SmemPlan(cfg.T)
    total_bar = 0
    for b in range(grid):
        _State.cta = CTA(b, plan.total, gmem)
        _State.cta.check_races(plan.ST, plan.CQ)          # state page, x / og rows, window
        _State.active = [np.ones(NT, bool)]
        with np.errstate(all="ignore"):     # garbage lanes (t >= T etc.) may hold NaN
            obj.kernel(mods["args"].KernelArgs(*ptrs, *scalars, Int32(grid)))
        if _State.cta.queue:
            _State.cta.wait_all()
        total_bar += _State.cta.barriers
    _State.cta = None
    return {"ctas": grid, "barriers": total_bar}
