#!/usr/bin/python3
"""Turns `terse bench allreduce` JSON files into the markdown tables of docs/benchmarks.md.

    bench/report.py results/allreduce-*.json
"""
import json
import sys


def hosts_table(path, r):
    """A run on hosts of several ranks: each configuration flat and in two levels, the busiest
    host link's bytes and ideal, and the two-level run against the flat one."""
    hosts = " | ".join(f"{h[0]}-{h[-1]}" if len(h) > 1 else str(h[0]) for h in r["hosts"])
    lines = [
        f"#### {r['ranks']} ranks on {len(r['hosts'])} hosts ({hosts}), "
        f"{r['bytes'] / 1e6:.0f} MB fp32, {r['link'] or 'loopback'} "
        f"(median of {r['reps']} runs; `{path}`)",
        "",
        "| configuration | median s | min s | MB on the busiest host link | ideal s | x ideal "
        "| two levels vs flat | ratio of the ideals |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    flat = {}
    for c in r["configs"]:
        key = (c["codec"], c["strategy"], c["partitions_requested"])
        med, ideal = c["median_s"], c.get("ideal_s") or 0
        if c["kind"] == "terse" and not c.get("hierarchical"):
            flat[key] = c
        f = flat.get(key) if c.get("hierarchical") else None
        note = "" if c.get("identical_across_ranks", True) else " (ranks differ)"
        gain = f"{f['median_s'] / med:.2f}x" if f else "-"
        ideal_gain = f"{f['ideal_s'] / ideal:.2f}x" if f and ideal else "-"
        lines.append(
            f"| {c['label']}{note} | {med:.4f} | {min(c['times_s']):.4f} "
            f"| {c['bytes_busiest_link'] / 1e6:.2f} | {f'{ideal:.4f}' if ideal else '-'} "
            f"| {f'{med / ideal:.2f}' if ideal else '-'} "
            f"| {gain} | {ideal_gain} |")
    return "\n".join(lines) + "\n"


def table(path):
    r = json.load(open(path))
    if any(len(h) > 1 for h in r.get("hosts", [])) and len(r.get("hosts", [])) > 1:
        return hosts_table(path, r)
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
