"""Plot a benchmark JSON: fraction of the copy-bandwidth floor vs R, one line per backend or
peer, one panel per T. Writes the PNG next to the JSON.

    python3 -m tools.bench.plot docs/results/<run>/bench-h200.json
"""

from __future__ import annotations

import os
import sys

from tools.bench.report import load_run


def plot_json(path: str) -> str:
    """Render ``path`` (a bench JSON) to ``<same name>.png``; returns the PNG path."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    meta, cells = load_run(path)
    heads = sorted({c["H"] for c in cells})
    Ts = sorted({c["T"] for c in cells})
    fig, axes = plt.subplots(len(heads), len(Ts), figsize=(5 * len(Ts), 4 * len(heads)), squeeze=False)
    for row, H in zip(axes, heads):
        for ax, T in zip(row, Ts):
            # one line per backend and state dtype (older runs: fp32 only, named as before)
            for name, sd in dict.fromkeys((c["backend"], c.get("state_dtype", "fp32"))
                                          for c in cells):
                pts = sorted((c["R"], c["frac"]) for c in cells
                             if c["backend"] == name and c["T"] == T and c["H"] == H
                             and c.get("state_dtype", "fp32") == sd)
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o",
                            label=name if sd == "fp32" else f"{name} ({sd} state)")
            ax.set_xscale("log", base=2)
            ax.set_xlabel("requests R")
            ax.set_ylabel("fraction of copy-bandwidth floor")
            ax.set_ylim(0, 1.05)
            ax.set_title(f"H = {H}, T = {T}")
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"{meta['device']}  {meta['date']}  commit {meta['commit']}  "
                 f"({meta['gate']} gate, {meta['layout']})", fontsize=9)
    fig.tight_layout()
    out = os.path.splitext(path)[0] + ".png"
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


if __name__ == "__main__":
    for p in sys.argv[1:]:
        print(plot_json(p))
