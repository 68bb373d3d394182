#!/usr/bin/python3
"""Turns `terse bench allreduce` JSON files into the markdown tables of docs/benchmarks.md.

    bench/report.py results/allreduce-*.json
"""
import json
import sys


def table(path):
    r = json.load(open(path))
    link = r["link"] or "unshaped loopback"
    best_gloo = r.get("best_gloo_median_s") or 0
    raw = r.get("terse_raw_median_s") or 0
    lines = [
        f"#### {r['ranks']} ranks, {r['bytes'] / 1e6:.0f} MB fp32, {link} "
        f"(median of {r['reps']} runs; `{path}`)",
        "",
        "| configuration | median s | CPU s/rank | MB sent/rank | ideal s | x ideal "
        "| vs best Gloo ring | vs terse raw |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c in r["configs"]:
        med = c["median_s"]
        ideal = c.get("ideal_s") or 0
        note = "" if c.get("identical_across_ranks", True) else " (ranks differ)"
        lines.append(
            f"| {c['label']}{note} | {med:.4f} | {c.get('cpu_s_per_rank', 0):.4f} "
            f"| {c['bytes_per_rank'] / 1e6:.2f} | {f'{ideal:.4f}' if ideal else '-'} "
            f"| {f'{med / ideal:.2f}' if ideal else '-'} "
            f"| {f'{best_gloo / med:.2f}x' if best_gloo else '-'} "
            f"| {f'{raw / med:.2f}x' if raw else '-'} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print("\n".join(table(p) for p in sys.argv[1:]))
