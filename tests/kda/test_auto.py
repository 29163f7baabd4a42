"""``auto``'s table is the ranking its measurement gives, and the fallback covers every backend."""

import collections
import json
import math
import os

import torch

from kda import auto, registry
from kda.config import KdaConfig

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_table_matches_its_measurement():
    with open(os.path.join(ROOT, auto.SOURCE)) as f:
        cells = json.load(f)["cells"]
    times = collections.defaultdict(list)
    for c in cells:
        if c["backend"] in registry.BACKEND_NAMES:
            times[(c["T"], c["backend"])].append(c["time_us"])
    for T, order in auto.MEASURED.items():
        gm = {b: math.exp(sum(map(math.log, v)) / len(v)) for (t, b), v in times.items() if t == T}
        assert tuple(sorted(gm, key=gm.get)) == order, (T, gm)


def test_orders():
    assert auto.auto_order(KdaConfig(num_heads=4), torch.device("cpu")) == ["reference"]
    for T in (1, 3, 8):
        order = auto.auto_order(KdaConfig(num_heads=4, T=T, window=T + 2), torch.device("cuda"))
        assert sorted(order) == sorted(registry.BACKEND_NAMES)
        assert order[0] == "cutedsl_wide"
        assert order[-1] == "reference"
