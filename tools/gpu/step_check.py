"""One decode step of a backend on fresh random inputs, checked against the reference: the
program the GPU session runs under compute-sanitizer (memcheck, racecheck, synccheck).

    python3 -m tools.gpu.step_check cutedsl 4 3 2        # backend, heads, requests, tokens
    python3 -m tools.gpu.step_check cuda 4 3 2 bf16      # ... with a bf16 state pool
    python3 -m tools.gpu.step_check cutedsl:streamg 8 100 1 bf16   # one schedule of the family
    python3 -m tools.gpu.step_check cutedsl:streamg 8 100 1 fp32 record   # record mode at T=1
    python3 -m tools.gpu.step_check cutedsl:stream+early 12 32 1 fp32 early  # early reads

``cutedsl:NAME`` runs the schedule of that name (:mod:`tools.schedules`).

The second step runs the DS layout with gate_mode 1, in record mode at T > 1 (and at T=1 with
``record``).

Exit status 0 when every buffer matches the reference (kda.testing.compare_step), 1 when one
does not, 2 when the arguments are refused (by this tool or by the backend) or no GPU is here.
"""

import dataclasses
import sys

import torch

from kda.errors import KdaArgumentError
from kda.testing import CaseSpec, call_public, compare_step, expected_after, make_case, make_config


def main(argv) -> int:
    if len(argv) < 4 or not all(a.isdigit() for a in argv[1:4]):
        print(f"step_check: expected BACKEND HEADS REQUESTS TOKENS [fp32|bf16] [record] [early] "
              f"(see the module docstring), got {' '.join(argv) or 'nothing'}", file=sys.stderr)
        return 2
    backend, H, R, T = argv[0], int(argv[1]), int(argv[2]), int(argv[3])
    if min(H, R, T) < 1:
        print(f"step_check: HEADS, REQUESTS and TOKENS: expected integers >= 1, got "
              f"{' '.join(argv[1:4])}", file=sys.stderr)
        return 2
    words = argv[5:]
    bad_words = any(w not in ("record", "early") for w in words) or len(set(words)) != len(words)
    if argv[4:5] not in ([], ["fp32"], ["bf16"]) or bad_words:
        print(f"step_check: after the tokens, a state dtype (fp32 or bf16) and then 'record' "
              f"and / or 'early' may follow, got {argv[4:]}", file=sys.stderr)
        return 2
    bf16_state = argv[4:5] == ["bf16"]
    record = T > 1 or "record" in words
    early = "early" in words
    cfgs = [dataclasses.replace(cfg, early_reads=early) for cfg in (
        make_config(H, T, "SD", lb=-5.0, bias=True, bf16_state=bf16_state),
        make_config(H, T, "DS", gm=1, record=record, bf16_state=bf16_state))]
    scheds = [None, None]
    if ":" in backend:      # cutedsl:NAME, the schedule NAME of the CuTe DSL family: both
        from tools.schedules import parse   # steps' schedules exist before anything runs
        try:
            scheds = [parse(backend.split(":", 1)[1], cfg)[1] for cfg in cfgs]
        except ValueError as e:
            print(f"step_check: {backend}: {e}", file=sys.stderr)
            return 2
    if not torch.cuda.is_available():
        print("step_check: runs a step on a CUDA GPU: none here", file=sys.stderr)
        return 2
    failures = 0
    for cfg, sched in zip(cfgs, scheds):
        args = make_case(CaseSpec(cfg, R=R, seed=H * 100 + R), "cuda")
        before, expected = expected_after(cfg, args)
        try:
            if sched is not None:
                from kda.backends.cutedsl.backend import KdaBackend
                KdaBackend.launcher(sched, cfg, torch.device("cuda"))(args)
            else:
                call_public(args, cfg, backend)
        except KdaArgumentError as e:   # what the backend refuses (e.g. its most tokens)
            print(f"step_check: {backend}: {e}", file=sys.stderr)
            return 2
        torch.cuda.synchronize()
        errors = compare_step(args, expected, before)
        print(f"{backend} {cfg.short()} R={R}: " + ("ok" if not errors else "; ".join(errors)))
        failures += bool(errors)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
