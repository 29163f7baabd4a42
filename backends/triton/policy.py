"""The Triton backend's launch policy: which build runs a step, by T and batch size.

Every call runs one build, chosen from the host-side batch size alone (``n_items = R * H``,
counted per SM of the device), so a CUDA graph captures the build of its batch size. Below one
item per SM the per-item kernel runs (:mod:`kda.backends.triton.kda_decode`), split into more
programs per item the smaller the batch (:data:`SMALL_BATCH`); from one item per SM on, a
build of the chunked kernel (:mod:`kda.backends.triton.kda_decode_chunked`) chosen by T and
items per SM (:data:`LARGE_BATCH`).

The figures are NVIDIA H200 (132 SMs) measurements at H = 32 (R = 1 / 8 / 32 / 128 / 512 are
0.24 / 1.9 / 7.8 / 31 / 124 items per SM), SD conv layout, softplus gate, T = 1, 2 and 5
(T = 3, 4 and 6-8 follow T = 5), by ``python3 -m tools.bench.bench --backends=triton``:
the step's median time, or its fraction of the copy-bandwidth floor (the bytes the step must
move at the copy bandwidth measured in the same run). To compare builds, change a row and
run the benchmark again.

This module imports neither Triton nor torch.
"""

from __future__ import annotations

from typing import NamedTuple, Optional


class Rule(NamedTuple):
    """One row of a policy table.

    Attributes:
      max_T: the largest T the row applies to; None = any.
      items_per_sm: the row's batch bound in items (R * H) per SM: at most this many in
        :data:`SMALL_BATCH`, at least this many in :data:`LARGE_BATCH`.
      build: the build's name (``kda_decode.BUILDS`` or ``kda_decode_chunked.BUILDS``).
      reason: why, with the measured figure.
    """

    max_T: Optional[int]
    items_per_sm: float
    build: str
    reason: str


#: Batches below one item per SM: the per-item kernel; the first row with at most
#: ``items_per_sm`` items per SM wins (any T).
SMALL_BATCH = (
    Rule(None, 0.25, "item_nv4",
         "4 programs per item stream each page through 4 SMs: at 0.24 items per SM 7.5 / 11.1 / "
         "20.2 us at T = 1 / 2 / 5, against 8.0 / 12.2 / 25.4 us with 2 and 10.5 / 18.9 / 40.9 "
         "us with 1"),
    Rule(None, 0.5, "item_nv2",
         "the step between: 2 programs per item beat 1 at 0.24 items per SM (8.0 against 10.5 us "
         "at T = 1) and lose to it at 1.9 (21.8 against 19.9 us); not measured in between"),
    Rule(None, 1.0, "item_nv1",
         "one 8-warp program per item once the grid fills half the SMs: at 1.9 items per SM "
         "19.9 us at T = 1 against 21.8 / 30.3 us with 2 / 4 programs per item"),
)

#: Batches from one item per SM on: the chunked kernel; the first row whose T bound holds
#: and with at least ``items_per_sm`` items per SM wins. The last row takes every T.
LARGE_BATCH = (
    Rule(1, 1, "chunked_w2_s3",
         "T = 1: 0.659 / 0.772 / 0.831 of the floor at R = 32 / 128 / 512, against 0.636 / 0.753 "
         "/ 0.804 for 4-warp 32-row programs with 2 stages and 0.614 / 0.770 / 0.832 with 3"),
    Rule(2, 4, "chunked_w2",
         "T = 2 from 4 items per SM: 0.666 / 0.748 / 0.797 of the floor at R = 32 / 128 / 512, "
         "against 0.614 / 0.709 / 0.759 for 4-warp 32-row programs"),
    Rule(2, 1, "chunked",
         "T = 2 below 4 items per SM: 25.0 us at R = 8, against 26.5 us for 2-warp programs"),
    Rule(None, 64, "chunked_bv16",
         "T >= 3 from 64 items per SM: 0.729 of the floor at T = 5, R = 512, against 0.713 for "
         "2-warp programs"),
    Rule(None, 4, "chunked_w2",
         "T >= 3 from 4 items per SM: 0.648 / 0.698 of the floor at T = 5, R = 32 / 128, "
         "against 0.608 / 0.684 for 4-warp 16-row programs"),
    Rule(None, 1, "chunked_bv16",
         "T >= 3 below 4 items per SM: 46.5 us at T = 5, R = 8, against 54.9 us for 2-warp "
         "programs"),
)


def choose(T: int, n_items: int, num_sms: int) -> str:
    """The name of the build that runs a step of ``n_items`` items (R * H, >= 1) at ``T``
    tokens on a device of ``num_sms`` SMs (>= 1)."""
    if n_items < num_sms:
        for rule in SMALL_BATCH:
            if n_items <= rule.items_per_sm * num_sms:
                return rule.build
    for rule in LARGE_BATCH:
        if (rule.max_T is None or T <= rule.max_T) and n_items >= rule.items_per_sm * num_sms:
            return rule.build
    raise AssertionError("LARGE_BATCH ends with a row for every T from 1 item per SM")


def builds() -> tuple:
    """The names of every build the policy can choose, in table order."""
    return tuple(dict.fromkeys(r.build for r in SMALL_BATCH + LARGE_BATCH))


__all__ = ["Rule", "SMALL_BATCH", "LARGE_BATCH", "choose", "builds"]
