#!/usr/bin/env python3
"""Repeated runs of bench/train.py side by side: per (link, model, method) present in more than
one results directory, each run's samples/s and time to the target accuracy, and their medians.

    bench/train_repeats.py results/train results/train-rep2 results/train-rep3
"""
import glob
import json
import os
import statistics
import sys
from typing import Dict, List, Tuple


def main(dirs: List[str]) -> None:
    runs: Dict[Tuple[str, str, str], List[Dict]] = {}
    for d in dirs:
        for path in sorted(glob.glob(os.path.join(d, "*", "*", "*.json"))):
            link, model, file = path.split(os.sep)[-3:]
            name = file[:-len(".json")]
            with open(path) as f:
                runs.setdefault((link, model, name), []).append(json.load(f))
    print("| link | model | method | runs | samples/s (median) | time to target s (median) "
          "| each run: samples/s, s |")
    print("|---|---|---|---:|---:|---:|---|")
    for (link, model, name), rs in sorted(runs.items()):
        if len(rs) < 2:
            continue
        rates = [r["samples_per_second"] for r in rs]
        ttas = [r["time_to_accuracy"] for r in rs]
        reached = [t for t in ttas if t is not None]
        tta = (f"{statistics.median(reached):.1f}" if len(reached) == len(ttas)
               else "not always reached")
        each = "; ".join(f"{a:,.0f}, {'-' if t is None else f'{t:.1f}'}"
                         for a, t in zip(rates, ttas))
        print(f"| {link} | {model} | {name} | {len(rs)} | {statistics.median(rates):,.0f} "
              f"| {tta} | {each} |")


if __name__ == "__main__":
    main(sys.argv[1:])
