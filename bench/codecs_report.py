#!/usr/bin/python3
"""Turns several `terse bench codecs --json` files (separate runs of the same benchmark) into the
markdown table of docs/benchmarks.md: per codec, the median over runs of encode and decode
throughput as a fraction of the memory copy measured in the same run, the lowest run's figure,
and the target.

    bench/codecs_report.py results/codecs-*.json
"""
import json
import statistics
import sys


def main(paths):
    runs = [json.load(open(p)) for p in paths]
    copies = [r["memcpy_gbs"] for r in runs]
    print(f"{runs[0]['elements']:,} floats, {len(runs)} runs (each the median of "
          f"{runs[0]['reps']} repetitions); memory copy per run: "
          + ", ".join(f"{c:.2f}" for c in copies) + " GB/s.\n")
    print("| codec | bytes | ratio | encode GB/s | decode GB/s | encode % of copy (lowest run) "
          "| decode % of copy (lowest run) | target | met in every run |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---|")
    specs = [c["spec"] for c in runs[0]["codecs"]]
    for spec in specs:
        rows = [next(c for c in r["codecs"] if c["spec"] == spec) for r in runs]
        enc = [c["encode_gbs"] / r["memcpy_gbs"] for c, r in zip(rows, runs)]
        dec = [c["decode_gbs"] / r["memcpy_gbs"] for c, r in zip(rows, runs)]
        met = all(c["meets_target"] for c in rows)
        print(f"| {spec} | {rows[0]['bytes']:,} | {rows[0]['ratio']:.2f} "
              f"| {statistics.median(c['encode_gbs'] for c in rows):.2f} "
              f"| {statistics.median(c['decode_gbs'] for c in rows):.2f} "
              f"| {100 * statistics.median(enc):.0f} % ({100 * min(enc):.0f} %) "
              f"| {100 * statistics.median(dec):.0f} % ({100 * min(dec):.0f} %) "
              f"| {100 * rows[0]['target_fraction']:.0f} % | {'yes' if met else 'NO'} |")


if __name__ == "__main__":
    main(sys.argv[1:])
