"""Plots the cost model's per-step communication time against world size, one line per strategy
and one for the planner's choice, from `terse plan --scale ... --json` files (one per link rate).

    /usr/bin/python3 bench/plot_planner_scale.py OUT.png TITLE A.json[:LABEL] B.json[:LABEL] ...
"""

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

STYLES = {
    "raw": ("black", "-", "raw (fp32 ring)"),
    "allgather": ("tab:orange", "--", "allgather"),
    "sharded": ("tab:blue", "-", "sharded"),
    "ring": ("tab:green", "--", "ring"),
    "summable": ("tab:purple", ":", "summable (fp16)"),
    "auto": ("tab:red", "-", "auto (planner)"),
}


def main(out, title, specs):
    fig, axes = plt.subplots(1, len(specs), figsize=(5.2 * len(specs), 4.4), sharey=False)
    if len(specs) == 1:
        axes = [axes]
    for ax, spec in zip(axes, specs):
        path, _, label = spec.partition(":")
        with open(path) as f:
            data = json.load(f)
        ranks = [row["ranks"] for row in data["scale"]]
        for key, (color, style, name) in STYLES.items():
            ys = [row[key] * 1e3 for row in data["scale"]]
            if min(ys) < 0:
                continue
            ax.plot(ranks, ys, style, color=color, label=name,
                    linewidth=2.6 if key == "auto" else 1.6, alpha=0.85 if key == "auto" else 1)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("ranks N")
        ax.set_title(label or path)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("predicted communication per step (ms)")
    axes[-1].legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
