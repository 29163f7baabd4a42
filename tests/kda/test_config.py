"""KdaConfig checks every field at construction, naming the field."""

import dataclasses

import numpy as np
import pytest
import torch

from kda.config import KdaConfig
from kda.errors import KdaArgumentError

BAD = [
    ("num_heads", 0, "H >= 1"), ("num_heads", 2.0, "expected an int"),
    ("num_heads", True, "expected an int"), ("T", 0, "T >= 1"), ("T", "1", "expected an int"),
    ("window", 2, "T + 2 = 3"), ("window", 3.0, "expected an int"),
    ("conv_layout", "sd", "SD"), ("lower_bound", 0.0, "[-5, 0)"),
    ("lower_bound", -5.5, "[-5, 0)"), ("lower_bound", -1e-50, "fp32"),
    ("lower_bound", "x", "float"), ("gate_mode", 2, "0 or 1"), ("gate_mode", True, "an int"),
    ("scale", 0.0, "> 0"), ("scale", None, "finite float"), ("scale", "x", "finite float"),
    ("scale", True, "finite float"), ("scale", 1e-320, "fp32"), ("scale", 1e39, "fp32"),
    ("norm_eps", None, "finite float"), ("norm_eps", float("nan"), "finite"),
    ("has_conv_bias", "yes", "bool"), ("record", 1, "bool"), ("beta_activated", "yes", "bool"),
    ("beta_activated", None, "bool"), ("early_reads", "yes", "bool"),
    ("conv_state_dtype", torch.float16, "expected dtype bfloat16 or float32, got float16"),
    ("conv_weight_dtype", torch.int32, "float32"),
    ("norm_weight_dtype", torch.float64, "float32"),
    ("state_dtype", torch.float16, "expected dtype float32 or bfloat16 (float16 state pools are "
                                   "not supported), got float16"),
    ("state_dtype", torch.float64, "expected dtype float32 or bfloat16, got float64"),
    ("state_dtype", "fp32", "got 'fp32'"),
]


@pytest.mark.parametrize("field,bad,text", BAD, ids=[f"{b[0]}={b[1]!r}" for b in BAD])
def test_bad_field_is_named(field, bad, text):
    with pytest.raises(KdaArgumentError) as ei:
        dataclasses.replace(KdaConfig(num_heads=2), **{field: bad})
    assert ei.value.arg == field and text in str(ei.value), str(ei.value)
    assert str(ei.value).startswith(f"{field}: ")


def test_window_defaults_to_T_plus_2_and_numbers_are_normalized():
    cfg = KdaConfig(num_heads=np.int64(3), T=2, lower_bound=np.float32(-5.0),
                    scale=np.float64(0.125), has_conv_bias=np.bool_(True))
    assert cfg.window == 4
    assert type(cfg.num_heads) is int and type(cfg.lower_bound) is float
    assert type(cfg.scale) is float and cfg.has_conv_bias is True
    assert hash(cfg) == hash(KdaConfig(num_heads=3, T=2, lower_bound=-5.0, scale=0.125,
                                       has_conv_bias=True))
    # replace keeps the resolved window unless told otherwise
    assert dataclasses.replace(cfg, T=1).window == 4
    assert dataclasses.replace(cfg, T=3, window=None).window == 5
