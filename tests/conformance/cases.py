"""The conformance matrix: which (config, batch) cases every backend must pass.

``ci``: small shapes that the reference and the Triton interpreter run in minutes on two CPU
cores, yet cover every axis of the contract's matrix: heads 1/4/12, T 1/2/5/8, both conv
layouts, both gates (lower_bound -5 and -1.5), gate_mode 0/1, conv bias, record mode, fp32
conv cache, bf16 conv/norm weights, longer windows, padded strides, null slots (0, -1, out of
range, dead conv slot), out-of-range accepted counts and aliasing write slots, and the
engine-facing forms (:func:`form_cases`).

``full``: the GPU matrix: H in {1, 4, 8, 12, 16, 32, 96}, R from 1 to 512, T in {1, 2, 5, 8},
every layout x gate combination for every H and T, the other axes rotated through (the
activated beta and the packed and offset rows among them), plus the forms of ``ci``.

The ``full`` matrix runs every case with each state pool dtype (:data:`STATE_DTYPES`: fp32 and
bf16). The ``ci`` matrix runs every case with an fp32 pool and the cases of :data:`CI_BF16`
with a bf16 one: the state dtype changes only how a page is loaded and stored, which those
cases reach on every path the CPU run has (each build the Triton policy picks at the
interpreter's 4 SMs, record mode, per-token writes with null and aliasing ids, padded slot
strides); the other axes do not meet the state's dtype. ``--kda-state-dtypes`` picks a subset.
"""

import dataclasses
import itertools

import torch

from kda.testing import CaseSpec, make_config

#: The state pool dtypes every case runs with, by their option names.
STATE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}




def form_cases():
    """The engine-facing argument forms: x, beta and f_a as slices of an engine's packed
    projection whose rows are 8-, 4- and 2-byte aligned (H = 4, 2, 3), output_gate and out at
    odd element offsets, an activated fp32 beta."""
    return [
        CaseSpec(make_config(4, 1, beta_act=True), R=3, packed=True),
        CaseSpec(make_config(2, 2, "DS", lb=-5.0, gm=1), R=3, packed=True),
        CaseSpec(make_config(3, 5, bias=True, beta_act=True), R=3, packed=True, offset_rows=True),
    ]


def ci_cases():
    c = [
        CaseSpec(make_config(1, 1), R=1, null_frac=0.0),
        CaseSpec(make_config(4, 1), R=5),
        CaseSpec(make_config(4, 1, "DS", lb=-5.0, gm=1, bias=True), R=4),
        CaseSpec(make_config(12, 1, "SD", gm=1, extra_window=2), R=2),
        CaseSpec(make_config(2, 1, "DS", cs32=True, bf16_weights=True), R=3, padded=True),
        CaseSpec(make_config(2, 2), R=4),
        CaseSpec(make_config(2, 2, "DS", lb=-1.5, bias=True), R=4, padded=True),
        CaseSpec(make_config(2, 5, "SD", lb=-5.0, gm=1), R=4),
        CaseSpec(make_config(2, 5, "DS", extra_window=3), R=5),
        CaseSpec(make_config(1, 8, "SD", bias=True, cs32=True), R=3),
        CaseSpec(make_config(1, 8, "DS", lb=-5.0, gm=1, bf16_weights=True), R=3),
        CaseSpec(make_config(2, 1, record=True), R=3),
        CaseSpec(make_config(2, 5, "DS", record=True, bias=True), R=4),
        CaseSpec(make_config(2, 2, "SD", lb=-5.0, record=True, gm=1), R=3, padded=True),
        CaseSpec(make_config(4, 2), R=3, null_frac=1.0),
    ]
    return c + form_cases()


#: The ``ci`` cases (indices into :func:`ci_cases`) that also run with a bf16 state pool, and
#: what each reaches (Triton builds at the interpreter's 4 SMs, :mod:`kda.backends.triton.policy`):
CI_BF16 = (
    0,    # 1 item, no null slots: the item kernel split 4 ways (item_nv4)
    1,    # T = 1, 20 items: the chunked kernel at T = 1 (chunked_w2_s3)
    6,    # T = 2, padded slot strides, bias, bounded gate: the chunked kernel at T = 2 (chunked)
    7,    # T = 5: the chunked kernel at T >= 3 (chunked_bv16), per-token writes, aliasing ids
    9,    # T = 8, 3 items: the whole-item kernel (item_nv1)
    12,   # T = 5 record mode: the state read, not written
)


def full_cases():
    heads = (1, 4, 8, 12, 16, 32, 96)
    Ts = (1, 2, 5, 8)
    combos = list(itertools.product(("SD", "DS"), (None, -5.0)))
    batches = (1, 3, 17, 64, 128, 512)
    cases = []
    i = 0
    for H in heads:
        for T in Ts:
            for layout, lb in combos:
                R = batches[i % len(batches)]
                while R * H * T > 16384 and R > 1:   # keep one case's state pool < ~2 GiB
                    R //= 2
                cfg = make_config(H, T, layout, lb=lb, gm=i % 2, bias=(i // 2) % 2 == 1,
                           record=(i % 5 == 3), extra_window=(i % 3), cs32=(i % 7 == 4),
                           bf16_weights=(i % 11 == 6), beta_act=(i % 3 == 1))
                cases.append(CaseSpec(cfg, R=R, padded=(i % 4 == 1), packed=(i % 4 == 3),
                                      offset_rows=(i % 8 == 5), null_frac=0.25, seed=i))
                i += 1
    return cases + form_cases()


def with_state_dtypes(specs, state_dtypes=tuple(STATE_DTYPES)):
    """Each spec once per state dtype name in ``state_dtypes`` (the spec as it is for fp32)."""
    return [dataclasses.replace(c, cfg=dataclasses.replace(c.cfg, state_dtype=STATE_DTYPES[d]))
            for c in specs for d in state_dtypes]


def cases(matrix: str, state_dtypes=tuple(STATE_DTYPES)):
    """The ``ci`` or ``full`` matrix with each of ``state_dtypes``: every case, except that
    ``ci`` runs only :data:`CI_BF16` with a bf16 pool."""
    if matrix == "full":
        return with_state_dtypes(full_cases(), state_dtypes)
    ci = ci_cases()
    return [c for i, spec in enumerate(ci) for c in with_state_dtypes([spec], state_dtypes)
            if c.cfg.state_dtype == torch.float32 or i in CI_BF16]
