"""Host cost per call of each entry point, with the kernel taken out.

A stand-in backend whose step does nothing isolates what the Python side costs per step:

* ``KdaDecode``: the object form (validated on the first call only), the direct eager path;
* ``kda_decode``: the functional form (derives the config and validates every call);
* ``torch.ops.kda.decode``: the ``torch.library`` op (dispatcher + a metadata comparison;
  full validation only when the arguments' metadata is new, as for ``KdaDecode``).

    python3 -m tools.bench.host_overhead [--heads=32 --batch=128 --tokens=1 --calls=2000]

Prints the median microseconds per call of each. Host costs, so meaningful on any machine
(the numbers are this machine's CPU); a CUDA graph replay pays none of them.
"""

from __future__ import annotations

import statistics
import time

import torch
from absl import app, flags

import kda
import kda.torch_op
from kda import dispatch, registry
from kda.backend import Backend
from kda.config import KdaConfig
from kda.testing import CaseSpec, make_case

FLAGS = flags.FLAGS


class _Null(Backend):
    name = "reference"          # stands in under a registered name so every path accepts it
    description = "does nothing (host-overhead measurement)"
    device_types = ("cpu", "cuda")

    def probe(self):
        return None

    def build(self, cfg, device):
        return lambda args: None


def _median_us(fn, calls: int) -> float:
    for _ in range(50):
        fn()
    ts = []
    for _ in range(calls):
        t0 = time.perf_counter_ns()
        fn()
        ts.append(time.perf_counter_ns() - t0)
    return statistics.median(ts) / 1e3


def measure(heads: int, batch: int, tokens: int, calls: int) -> dict:
    """{entry point: median us per call} with the null backend."""
    registry._loaded["reference"] = _Null()
    registry._steps.clear()
    dispatch._resolved.clear()
    cfg = KdaConfig(num_heads=heads, T=tokens, window=tokens + 2)
    a = make_case(CaseSpec(cfg, R=batch, null_frac=0.0))
    pos = a[:13]                # the positional parameters (KdaArgs has the public order)
    kw = dict(num_accepted_tokens=a.num_accepted_tokens, out=a.out)
    obj = kda.KdaDecode(cfg, device="cpu", backend="reference")
    try:
        return {
            "KdaDecode (object, direct)": _median_us(lambda: obj(*pos, **kw), calls),
            "kda_decode (functional)": _median_us(lambda: kda.kda_decode(*pos, backend="reference", **kw), calls),
            "torch.ops.kda.decode (custom op)": _median_us(
                lambda: kda.torch_op.decode(*pos, backend="reference", **kw), calls),
        }
    finally:
        registry._loaded.pop("reference", None)
        registry._steps.clear()
        dispatch._resolved.clear()


def main(argv):
    del argv
    res = measure(FLAGS.heads, FLAGS.batch, FLAGS.tokens, FLAGS.calls)
    print(f"host cost per call, kernel excluded (H={FLAGS.heads} R={FLAGS.batch} T={FLAGS.tokens}, "
          f"median of {FLAGS.calls}, torch {torch.__version__}, this machine's CPU):")
    for k, v in res.items():
        print(f"  {k:34s} {v:8.1f} us")


if __name__ == "__main__":
    # flags defined here, not at import: tools.bench.bench defines --heads as a list
    flags.DEFINE_integer("heads", 32, "H")
    flags.DEFINE_integer("batch", 128, "R")
    flags.DEFINE_integer("tokens", 1, "T")
    flags.DEFINE_integer("calls", 2000, "timed calls per entry point")
    app.run(main)
