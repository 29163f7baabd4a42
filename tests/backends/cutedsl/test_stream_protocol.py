"""A model of the streamed kernel's item-slot protocol (:mod:`kda.backends.cutedsl.stream`),
run on the CPU under random interleavings of its warps.

The model is the kernel's synchronization and nothing else: mbarriers with their arrival
counts and phase-parity waits, the 4 prep warps' order (item j's prep, then item j - LAG's
epilogue, then the trailing epilogues), with their named barrier between writing and reading
a live item's warp sums (the q / k norms', then the epilogue's, in the slot's sums), and each
consumer warp of group g walking the items j = g, g + groups, ... (a dead item: its *ready*
waited for and *done* arrived, as a live one). It takes the kernel's own slot count and lag
for each ring shape. With ``group_prep`` the prep has no epilogue: each consumer warp waits
for *free* before a live item's conv, then for *ready*, and arrives *free* after the item (a
dead one: *ready*, then *free*). It checks that every wait passes only once the phase it is
meant for has completed (a parity wait passes too when the barrier is two phases behind:
that is the failure to find), that no barrier receives more arrivals than its count, that
every warp reads the 4 warp sums of its own item (no warp has overwritten them for a later
item), and that nothing deadlocks.
"""

import random

import pytest
import torch

pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl not installed")

from kda.backends.cutedsl import schedule as S  # noqa: E402
from kda.backends.cutedsl.problem import Problem  # noqa: E402
from kda.backends.cutedsl.stream import KdaStream  # noqa: E402
from kda.config import KdaConfig  # noqa: E402


class _Bar:
    """An mbarrier: ``count`` arrivals complete a phase; ``passes(p)`` is try_wait.parity."""

    def __init__(self, count, errors, name):
        self.count, self.pending, self.phase = count, count, 0
        self.errors, self.name = errors, name

    def arrive(self, n=1):
        if n > self.pending:
            self.errors.append(f"{self.name}: {n} arrivals with {self.pending} pending")
        self.pending -= n
        if self.pending <= 0:
            self.phase += 1
            self.pending = self.count

    def passes(self, parity):
        return (self.phase & 1) != parity


def _run(kernel, live, seed):
    """Errors of one random interleaving of one CTA walking ``len(live)`` items."""
    rnd = random.Random(seed)
    NI, LAG, units, groups = kernel.NI, kernel.LAG, kernel.units, kernel.sched.groups
    n = len(live)
    errors = []
    PW = 4      # prep warps; each arrives once (the model's unit: a warp's 32 threads)
    ready = [_Bar(PW, errors, f"ready{i}") for i in range(NI)]
    done = [_Bar(units, errors, f"done{i}") for i in range(NI)]
    gp = kernel.group_prep
    free = [_Bar(units if gp else PW, errors, f"free{i}") for i in range(NI)]
    # the slots' warp sums: (slot, norm | epilogue, warp) -> the item that wrote it
    sums = {}
    gen = [0, 0]        # the prep warps' named barrier: generation, arrivals in it

    def wait(bar, parity, want, who):
        while not bar.passes(parity):
            yield
        if bar.phase != want:
            errors.append(f"{who} passed {bar.name} at phase {bar.phase}, meant for {want}")

    def bar_sync():
        g = gen[0]
        gen[1] += 1
        if gen[1] == PW:
            gen[0], gen[1] = g + 1, 0
        while gen[0] == g:
            yield

    def sums_of(s, kind, j, w, who):
        """Warp w writes its sum of item j, the 4 warps sync, then it reads all 4."""
        sums[s, kind, w] = j
        yield
        yield from bar_sync()
        yield
        for v in range(PW):
            if sums.get((s, kind, v)) != j:
                errors.append(f"{who} read warp {v}'s {kind} sum of item "
                              f"{sums.get((s, kind, v))}, meant for {j}")

    def prep(w):
        for j in range(n + LAG):
            if j < n:       # prep(j): waits for the slot, fills it, then ready
                s, k = j % NI, j // NI
                who = f"prep {w} item {j}"
                yield from wait(free[s], (k & 1) ^ 1, k, who)
                yield
                if not gp and live[j]:
                    yield from sums_of(s, "norm", j, w, who)
                ready[s].arrive()
            e = j - LAG
            if not gp and 0 <= e and (j < n or e >= max(n - LAG, 0)):      # epilogue(e)
                s, k = e % NI, e // NI
                who = f"epilogue {w} item {e}"
                yield from wait(done[s], k & 1, k + 1, who)
                yield
                if live[e]:
                    yield from sums_of(s, "rms", e, w, who)
                free[s].arrive()

    def consumer(g, w):
        for j in range(g, n, groups):
            s, k = j % NI, j // NI
            who = f"consumer {g}.{w} item {j} (live {live[j]})"
            if gp and live[j]:      # the group's conv writes the slot
                yield from wait(free[s], (k & 1) ^ 1, k, who)
                yield
            yield from wait(ready[s], k & 1, k + 1, who)
            for _ in range(rnd.randint(0, 3)):
                yield
            (free if gp else done)[s].arrive()

    agents = ([prep(w) for w in range(PW)]
              + [consumer(g, w) for g in range(groups) for w in range(units)])
    for _ in range(100000):
        if not agents:
            return errors
        a = rnd.choice(agents)
        try:
            next(a)
        except StopIteration:
            agents.remove(a)
    return errors + ["deadlock"]


PB = Problem.from_config(KdaConfig(num_heads=4, T=1, window=3))


@pytest.mark.parametrize("rows,consumers,depth", [(32, 8, 1), (16, 8, 2), (64, 4, 1)],
                         ids=["rows32", "rows16", "rows64"])
def test_item_slot_protocol(rows, consumers, depth):
    _check_protocol(KdaStream(PB, S.stream(PB, unit_rows=rows, consumers=consumers,
                                           depth=depth)))


@pytest.mark.parametrize("consumers", [4, 8, 20], ids=["1group", "2groups", "5groups"])
def test_item_slot_protocol_group_prep(consumers):
    """The groups' prep with 1 to 5 consumer groups (on bf16 pages, one stage a warp: 5 groups'
    units fit; the schedule refuses more groups: its 5 item slots would be passed by the
    sixth)."""
    pb = Problem.from_config(KdaConfig(num_heads=4, T=1, window=3, state_dtype=torch.bfloat16))
    _check_protocol(KdaStream(pb, S.stream(pb, prep=S.Prep.GROUP, consumers=consumers,
                                           depth=1)))


def _check_protocol(kernel):
    rnd = random.Random(1)
    for seed in range(400):
        n = rnd.randint(0, 24)
        dead = rnd.choice([0.0, 0.3, 0.7])
        live = [rnd.random() >= dead for _ in range(n)]
        errors = _run(kernel, live, seed)
        assert not errors, f"n={n} live={[int(x) for x in live]}: {errors[:3]}"
