"""The ``cuda`` backend's launch policy: what the launcher chooses for each T, and why.

The kernel (``kda_decode.cu``) walks the R*H work items on a persistent grid (the resident
CTAs, two per SM): each CTA first walks a contiguous head-major range of
``floor(static_fraction * items / CTAs)`` items, then takes items one by one from an atomic
counter. The static ranges keep consecutive items on one head (its parameters, and at T=1 its
f_b rows, are staged once per head); the counter evens out SMs that run at different speeds.
``fb_smem`` names the kernel build for the T and the state dtype: whether it stages each head's
f_b rows (32 KiB) in shared memory or reads the gate MMA's fragments from L2 for every item.

Every figure is a step time on an H200 at H=32 heads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Tuple


@dataclass(frozen=True)
class Policy:
    """The launch choices for one T.

    Attributes:
      static_fraction: fraction f in [0, 1] of each CTA's share of the items that it walks as
        one contiguous range before it takes items from the counter (0: every item after its
        first from the counter).
      fb_smem: the kernel build stages each head's f_b rows in shared memory (the T=1 builds
        and the bf16-state builds do; the binding rejects any other pairing).
      why: one line per choice, with the measurement behind it.
    """

    static_fraction: float
    fb_smem: bool
    why: Tuple[str, ...]


#: T=1 (plain decode).
DECODE = Policy(static_fraction=0.8, fb_smem=True, why=(
    "static_fraction 0.8: 156.7 us against 162.1 us with static ranges only at R=128 (595.5 "
    "against 607.8 at R=512); 0.9 is within 0.3%, 0.6 is 0.4-1.3% slower",
    "fb_smem: 164.4 us against 171.8 us with the fragments read from L2 at R=128 (4-6% faster "
    "from R=32 to R=512)",
))

#: T=2..8 (speculative verify).
VERIFY = Policy(static_fraction=0.0, fb_smem=False, why=(
    "static_fraction 0: 244.0 us against 252.7 us with static ranges only at R=128, T=2, and "
    "469.5 us against 475.6 us with 0.8 at R=128, T=5",
    "no fb_smem: 32 KiB more shared memory does not fit two CTAs per SM next to T >= 2 tokens' "
    "buffers (T=2: 87,952 B + 32 KiB > 115,712 B)",
))

#: T=1 with a bf16 state pool.
DECODE_BF16 = Policy(static_fraction=DECODE.static_fraction, fb_smem=True, why=(
    "static_fraction 0.8, measured with fp32 pages only: " + DECODE.why[0].split(": ", 1)[1],
    DECODE.why[1],
))

#: T=2..8 with a bf16 state pool.
VERIFY_BF16 = Policy(static_fraction=VERIFY.static_fraction, fb_smem=True, why=(
    "static_fraction 0, measured with fp32 pages only: " + VERIFY.why[0].split(": ", 1)[1],
    "fb_smem: a bf16 page's staging is 32 KiB smaller, which holds the f_b rows (T=8: 113,376 B "
    "in all); the build that reads the fragments from L2 spills 48-80 B at T=2..8",
))

#: The policy of every (T, bf16 state) the kernel is built for.
POLICY: Dict[Tuple[int, bool], Policy] = {
    **{(t, False): DECODE if t == 1 else VERIFY for t in range(1, 9)},
    **{(t, True): DECODE_BF16 if t == 1 else VERIFY_BF16 for t in range(1, 9)},
}


def policy(T: int, bf16_state: bool = False) -> Policy:
    """The launch policy for T tokens per request, with an fp32 (default) or bf16 state pool.

    Raises:
      KeyError: the kernel has no build for T (T outside 1..8).
    """
    return POLICY[T, bool(bf16_state)]
