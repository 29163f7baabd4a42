"""A KDA layer's parameters in the Hugging Face Kimi-Linear layout, and a synthetic one.

Parameter names and shapes follow the Kimi-Linear checkpoints (``model.layers.{i}.self_attn.``
followed by the names below; ``hidden`` = 2304 and 32 heads of 128 for Kimi-Linear-48B-A3B).
:func:`write_synthetic` writes a seeded random checkpoint of those shapes, labelled synthetic
in its metadata, so the serve tool runs with no download.

Run it as a script to write one::

    python3 -m tools.serve.checkpoint --out /tmp/kda_layer.safetensors --seed 0
"""

from __future__ import annotations

import math
import os
from typing import Dict

import torch

D = 128
#: Kimi-Linear-48B-A3B: hidden size and KDA heads of the whole model (TP 1).
KIMI_LINEAR_HIDDEN = 2304
KIMI_LINEAR_HEADS = 32


def param_shapes(hidden: int, heads: int) -> Dict[str, tuple]:
    """Name -> shape of one KDA layer's parameters (names after the ``self_attn.`` prefix)."""
    dim = heads * D
    return {
        "q_proj.weight": (dim, hidden),
        "k_proj.weight": (dim, hidden),
        "v_proj.weight": (dim, hidden),
        "q_conv1d.weight": (dim, 1, 4),
        "k_conv1d.weight": (dim, 1, 4),
        "v_conv1d.weight": (dim, 1, 4),
        "A_log": (1, 1, heads, 1),
        "dt_bias": (dim,),
        "f_a_proj.weight": (D, hidden),
        "f_b_proj.weight": (dim, D),
        "b_proj.weight": (heads, hidden),
        "g_a_proj.weight": (D, hidden),
        "g_b_proj.weight": (dim, D),
        "o_norm.weight": (D,),
        "o_proj.weight": (hidden, dim),
    }


def prefix(layer: int) -> str:
    return f"model.layers.{layer}.self_attn."


def synthetic_params(hidden: int = KIMI_LINEAR_HIDDEN, heads: int = KIMI_LINEAR_HEADS,
                     seed: int = 0) -> Dict[str, torch.Tensor]:
    """Seeded random parameters of the real shapes (bf16 weights, fp32 A_log / dt_bias)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in param_shapes(hidden, heads).items():
        if name == "A_log":
            t = torch.log(torch.rand(shape, generator=g) * 15 + 1)
        elif name == "dt_bias":
            t = torch.randn(shape, generator=g) * 0.5 - 2.0
        elif name == "o_norm.weight":
            t = 1 + 0.1 * torch.randn(shape, generator=g)
        elif "conv1d" in name:
            t = torch.randn(shape, generator=g) * 0.5
        else:
            t = torch.randn(shape, generator=g) / math.sqrt(shape[1])
        dt = torch.float32 if name in ("A_log", "dt_bias") else torch.bfloat16
        out[name] = t.to(dt)
    return out


def write_synthetic(path: str, *, layer: int = 0, hidden: int = KIMI_LINEAR_HIDDEN,
                    heads: int = KIMI_LINEAR_HEADS, seed: int = 0) -> str:
    """Write a synthetic checkpoint to ``path`` (atomically); returns ``path``."""
    from safetensors.torch import save_file
    params = {prefix(layer) + k: v.contiguous() for k, v in
              synthetic_params(hidden, heads, seed).items()}
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    save_file(params, tmp, metadata={
        "content": "SYNTHETIC random parameters of one Kimi-Linear KDA layer (not a trained model)",
        "seed": str(seed), "hidden": str(hidden), "heads": str(heads), "layer": str(layer)})
    os.replace(tmp, path)
    return path


def load_layer(path: str, layer: int = 0) -> tuple:
    """(params by short name, metadata) of one layer from a safetensors file.

    Raises:
      KeyError: a parameter is missing (the message lists what the file has).
      ValueError: a parameter has an unexpected shape.
    """
    from safetensors import safe_open
    pre = prefix(layer)
    with safe_open(path, framework="pt") as f:
        meta = f.metadata() or {}
        keys = [k for k in f.keys() if k.startswith(pre)]
        params = {k[len(pre):]: f.get_tensor(k) for k in keys}
    for name in ("A_log", "q_proj.weight"):        # (they give the shapes of the others)
        if name not in params:
            raise KeyError(f"{path}: missing {pre}{name}; tensors with that prefix: "
                           f"{sorted(params)}")
    heads = params["A_log"].numel()
    hidden = params["q_proj.weight"].shape[1]
    for name, shape in param_shapes(hidden, heads).items():
        if name not in params:
            raise KeyError(f"{path}: missing {pre}{name}")
        if tuple(params[name].shape) != shape:
            raise ValueError(f"{path}: {pre}{name} has shape {list(params[name].shape)}, "
                             f"expected {list(shape)}")
    return params, meta


if __name__ == "__main__":
    from absl import app, flags

    flags.DEFINE_string("out", "kda_layer_synthetic.safetensors", "where to write")
    flags.DEFINE_integer("seed", 0, "random seed")
    flags.DEFINE_integer("hidden", KIMI_LINEAR_HIDDEN, "hidden size")
    flags.DEFINE_integer("heads", KIMI_LINEAR_HEADS, "KDA heads (whole model)")
    flags.DEFINE_integer("layer", 0, "layer index in the parameter names")

    def main(argv):
        del argv
        F = flags.FLAGS
        from tools.flags import user_path
        print(write_synthetic(user_path(F.out), layer=F.layer, hidden=F.hidden, heads=F.heads,
                              seed=F.seed))

    app.run(main)
