#!/usr/bin/env python3
"""Repeated runs of bench/train.py side by side: per (link, model, method) present in more than
one results directory, each run's samples/s and time to the target accuracy, and their medians.

    bench/train_repeats.py results/train results/train-rep2 results/train-rep3

For the language model (task "lm") each directory is one invocation (typically one seed) with
its own DDP fp32 run and compute-only floor: a method's time to the target is its time to that
directory's DDP final validation loss, its loss is compared with that DDP's, and S is computed
per directory; the table gives medians of times and rates, and means of losses.
"""
import glob
import json
import os
import statistics
import sys
from typing import Dict, List, Optional, Tuple

from terse_harness import lm


def _reached(run: Dict, loss: float) -> Optional[Tuple[float, int]]:
    """(training seconds, step) of the first evaluation at or below ``loss``, else None."""
    c = lm.first_reached(run["curve"], loss)
    return None if c is None else (c["train_seconds"], c["step"])


def _bytes_after_freeze(run: Dict) -> Optional[float]:
    """Wire (else payload) bytes per step per rank after terse.optim's variance froze, from the
    curve's counters (rank 0's) between the first evaluation at or after the freeze and the
    last."""
    config = run["config"]
    if config.get("optimizer") not in ("onebit-adam", "zeroone-adam"):
        return None
    freeze = max(1, round(config.get("freeze_fraction", 0.2) * run["steps"]))
    curve = [c for c in run["curve"] if c["step"] >= freeze]
    key = "wire_bytes" if curve and curve[0].get("wire_bytes") is not None else "payload_bytes"
    if len(curve) < 2 or curve[0].get(key) is None or curve[-1]["step"] == curve[0]["step"]:
        return None
    return (curve[-1][key] - curve[0][key]) / (curve[-1]["step"] - curve[0]["step"])


def _fmt(x: Optional[float], spec: str) -> str:
    return "-" if x is None else format(x, spec)


def lm_table(runs: Dict[Tuple[str, str, str], List[Tuple[str, Dict]]], link: str,
             model: str) -> None:
    """One language-model table over the directories: per method, medians of windows/s and of
    the time to each directory's DDP final loss, the mean final loss against DDP's, bytes."""
    by_dir: Dict[str, Dict[str, Dict]] = {}
    for (l, m, name), rs in runs.items():
        if (l, m) == (link, model):
            for d, r in rs:
                by_dir.setdefault(d, {})[name] = r
    s_values, ddp_seconds = [], {}
    for d, named in sorted(by_dir.items()):
        ddp, floor = named.get("ddp"), named.get("compute-only")
        if ddp and ddp.get("val_loss") is not None:
            reached = _reached(ddp, ddp["val_loss"])
            ddp_seconds[d] = reached[0] if reached else None
            if reached and floor:
                s_values.append(reached[0] / (reached[1] * floor["median_step_seconds"]))
    seeds = [str(next(iter(named.values()))["config"].get("seed", 0))
             for _, named in sorted(by_dir.items())]
    print(f"### {link}, {model}: {len(by_dir)} invocations (seeds {', '.join(seeds)})")
    print()
    if s_values:
        print(f"S (DDP fp32's time to its final loss over the floor's for as many steps), per "
              f"invocation: {', '.join(f'{v:.2f}' for v in s_values)}; median "
              f"{statistics.median(s_values):.2f}")
        print()
    print("| method | runs | windows/s | wire MB/step/rank | after freeze | val loss (mean) "
          "| vs DDP (mean) | time to DDP's loss s (each) | sooner than DDP | x floor |")
    print("|---|---:|---:|---:|---:|---:|---:|---|---:|---:|")
    names = sorted({n for named in by_dir.values() for n in named},
                   key=lambda n: (n != "ddp", n == "compute-only", n))
    for name in names:
        rs = [(d, named[name]) for d, named in sorted(by_dir.items()) if name in named]
        local = rs[0][1]["config"]["method"] in ("local", "sync")
        rate = statistics.median(r["samples_per_second"] for _, r in rs)
        wires = [r.get("wire_bytes_per_step") for _, r in rs]
        wire = statistics.median(wires) / 1e6 if None not in wires else None
        after = [_bytes_after_freeze(r) for _, r in rs]
        after_mb = statistics.median(after) / 1e6 if None not in after else None
        losses, deltas, times, ratios, floors = [], [], [], [], []
        for d, r in rs:
            named = by_dir[d]
            ddp, floor = named.get("ddp"), named.get("compute-only")
            if local or r.get("val_loss") is None:
                continue
            losses.append(r["val_loss"])
            if ddp and ddp.get("val_loss") is not None:
                deltas.append(100 * (r["val_loss"] / ddp["val_loss"] - 1))
                reached = _reached(r, ddp["val_loss"])
                times.append(reached[0] if reached else None)
                if reached and ddp_seconds.get(d):
                    ratios.append(ddp_seconds[d] / reached[0])
                if reached and floor:
                    floors.append(reached[0] / (reached[1] * floor["median_step_seconds"]))
        each = ", ".join("-" if t is None else f"{t:.0f}" for t in times)
        reached_all = times and None not in times
        median_time = f"{statistics.median(times):.0f}" if reached_all else "not always"
        print(f"| {rs[0][1]['label']} | {len(rs)} | {rate:.1f} | {_fmt(wire, '.3g')} "
              f"| {_fmt(after_mb, '.3g')} "
              f"| {_fmt(statistics.mean(losses) if losses else None, '.4f')} "
              f"| {_fmt(statistics.mean(deltas) if deltas else None, '+.2f')}"
              f"{' %' if deltas else ''} "
              f"| {'-' if local else f'{median_time} ({each})'} "
              f"| {_fmt(statistics.median(ratios) if reached_all and ratios else None, '.2f')} "
              f"| {_fmt(statistics.median(floors) if reached_all and floors else None, '.2f')} |")
    print()


def main(dirs: List[str]) -> None:
    runs: Dict[Tuple[str, str, str], List[Dict]] = {}
    tagged: Dict[Tuple[str, str, str], List[Tuple[str, Dict]]] = {}
    for d in dirs:
        for path in sorted(glob.glob(os.path.join(d, "*", "*", "*.json"))):
            link, model, file = path.split(os.sep)[-3:]
            name = file[:-len(".json")]
            with open(path) as f:
                r = json.load(f)
            runs.setdefault((link, model, name), []).append(r)
            tagged.setdefault((link, model, name), []).append((d, r))
    lm = sorted({(l, m) for (l, m, _), rs in runs.items() if rs[0].get("task") == "lm"})
    for link, model in lm:
        lm_table(tagged, link, model)
    runs = {k: v for k, v in runs.items() if (k[0], k[1]) not in lm}
    if not runs:
        return
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
