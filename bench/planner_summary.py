"""Summary of `terse bench planner` runs (bench/planner_accuracy.sh writes them).

    python3 bench/planner_summary.py results/planner/*.json

Prints Markdown tables: the prediction error (median of |predicted / measured - 1| over every
configuration measured, each measurement itself a median over reps of the slowest rank), the
automatic choice against the best configuration measured in the same run (exhaustive search
over the candidates the planner considers), and codec auto against raw with the engine's
default partitions.
"""

import json
import statistics
import sys


def label_of(path, run):
    link = run.get("link") or "unshaped"
    return link, run["ranks"]


def main(paths):
    runs = []
    for path in paths:
        with open(path) as f:
            runs.append(json.load(f))
    links = ["unshaped", "1gbit", "100mbit"]
    runs.sort(key=lambda r: (links.index(r.get("link") or "unshaped")
                             if (r.get("link") or "unshaped") in links else 9, r["ranks"]))

    errors_all = []
    print("## Prediction error: |predicted / measured - 1|, median over the configurations measured\n")
    sizes = [s["size"] for s in runs[0]["sizes"]] if runs else []
    # The signed median (predicted / measured - 1) tells a bias of the whole point (every
    # configuration predicted fast or slow: the calibration against the runs) from scatter.
    print("| link | N | " + " | ".join(sizes) + " | all sizes | signed | configurations |")
    print("|---|---|" + "---|" * (len(sizes) + 3))
    for run in runs:
        link, n = label_of(None, run)
        cells, point, signed = [], [], []
        for size in run["sizes"]:
            errs = [c["predicted_s"] / c["median_s"] - 1 for c in size["configs"]
                    if c["median_s"] > 0]
            signed += errs
            errs = [abs(e) for e in errs]
            point += errs
            cells.append(f"{100 * statistics.median(errs):.0f}%" if errs else "-")
        errors_all += point
        print(f"| {link} | {n} | " + " | ".join(cells) +
              f" | {100 * statistics.median(point):.1f}% | "
              f"{100 * statistics.median(signed):+.1f}% | {len(point)} |")
    if errors_all:
        print(f"\nOverall median |error|: {100 * statistics.median(errors_all):.1f}% over "
              f"{len(errors_all)} measured configurations; within 15%: "
              f"{sum(e <= 0.15 for e in errors_all)} of {len(errors_all)}.")
    # The noise floor: the chosen configuration is timed twice in each run (as a candidate and
    # through codec auto); how far apart are the two medians?
    repeat = []
    for run in runs:
        for size in run["sizes"]:
            by_label = {c["label"]: c for c in size["configs"] if c["candidate"]}
            auto = [c for c in size["configs"] if c["label"].startswith("codec auto")]
            cand = by_label.get(size["chosen"])
            if auto and cand and cand["median_s"] > 0:
                repeat.append(abs(auto[0]["median_s"] / cand["median_s"] - 1))
    if repeat:
        print(f"Noise floor: the same configuration timed twice in one run (as a candidate and "
              f"through codec auto) differs by a median {100 * statistics.median(repeat):.1f}% "
              f"(largest {100 * max(repeat):.0f}%, {len(repeat)} points).\n")

    print("## Automatic choice against the best measured configuration, and against raw\n")
    print("| link | N | size | model's choice | choice (explored) | choice ms | best measured "
          "| best ms | choice / best | timed again: choice / best | raw default ms | auto / raw "
          "(timed again) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    within, within_again, total, model_within, harm, harm_first = 0, 0, 0, 0, [], []
    controls, misses = [], []
    for run in runs:
        link, n = label_of(None, run)
        for size in run["sizes"]:
            ratio = size["auto_median_s"] / size["best_median_s"]
            vs_raw = size["auto_median_s"] / size["raw_default_median_s"]
            # Where the search's best was not the choice, both were timed again, alternating
            # (tools/bench_planner.cpp: the least of many noisy medians is biased low): the
            # median of the pairs' ratios where the run recorded it, else the ratio of the two
            # medians.
            if "again_pair_ratio" in size:
                again = size["again_pair_ratio"]
            elif "again_best_median_s" in size:
                again = size["again_choice_median_s"] / size["again_best_median_s"]
            else:
                again = ratio
            total += 1
            within += ratio <= 1.05
            within_again += again <= 1.05
            predicted = size.get("predicted_choice", size["chosen"])
            by_label = {c["label"]: c for c in size["configs"] if c["candidate"]}
            if predicted in by_label and by_label[predicted]["median_s"] > 0:
                model_within += by_label[predicted]["median_s"] / size["best_median_s"] <= 1.05
            # Where auto and the raw default came out close, both were timed again in pairs:
            # the median of the pairs' ratios is the figure there.
            vs_raw_again = size.get("raw_again_pair_ratio", vs_raw)
            vs_raw_cell = f"{vs_raw:.3f}"
            if "raw_again_pair_ratio" in size:
                vs_raw_cell += f" (again: {vs_raw_again:.3f})"
            if link == "unshaped":
                harm_first.append(vs_raw)
                harm.append(vs_raw_again)
            again_cell = f"{again:.3f}" if "again_best_median_s" in size else "-"
            # The best timed against itself on a second tensor, in as many pairs: how far apart
            # the pairs put identical configurations at this point.
            control_cell = ""
            if "control_pair_ratio" in size:
                controls.append(size["control_pair_ratio"])
                control_cell = f" (control {size['control_pair_ratio']:.3f})"
            again_cell += control_cell
            if again > 1.05:
                misses.append(f"{link} N = {n} {size['size']}: {again:.3f}{control_cell}")
            print(f"| {link} | {n} | {size['size']} | {predicted} | {size['chosen']} | "
                  f"{1e3 * size['auto_median_s']:.3f} | {size['best']} | "
                  f"{1e3 * size['best_median_s']:.3f} | {ratio:.3f} | {again_cell} | "
                  f"{1e3 * size['raw_default_median_s']:.3f} | {vs_raw_cell} |")
    if total:
        print(f"\nChoice within 5% of the best measured: {within} of {total} points; "
              f"{within_again} of {total} where the choice and the search's best are timed "
              f"again against each other. The model's own choice (before exploration) was "
              f"within 5% of the best at {model_within} of {total}.")
        if misses:
            print("Timed again above 1.05: " + "; ".join(misses) + ".")
    if controls:
        spread = [abs(c - 1) for c in controls]
        print(f"Control (the best against itself on a second tensor, in as many pairs): "
              f"|ratio - 1| median {100 * statistics.median(spread):.1f}%, largest "
              f"{100 * max(spread):.1f}% over {len(controls)} points.")
    if harm:
        print(f"Unshaped loopback, auto / raw (timed again in pairs where close): worst "
              f"{max(harm):.3f}, median "
              f"{statistics.median(harm):.3f} over {len(harm)} points (do no harm: at most "
              f"1.05); in the first timing alone, worst {max(harm_first):.3f}.")
    exploration(runs)
    targets(runs)


def choice_over_best(size):
    """The choice over the best measured configuration: the pairs' ratio where the two were
    timed again against each other, else the ratio of their medians."""
    if "again_pair_ratio" in size:
        return size["again_pair_ratio"]
    if "again_best_median_s" in size:
        return size["again_choice_median_s"] / size["again_best_median_s"]
    return size["auto_median_s"] / size["best_median_s"]


def targets(runs):
    """The three figures the planner is judged by (on held-out conditions): the median
    prediction error, the share of points whose automatic choice is within 10% of the best
    measured configuration, and codec auto against raw on unshaped links."""
    errors, within, points, harm = [], 0, 0, []
    for run in runs:
        link, _ = label_of(None, run)
        for size in run["sizes"]:
            errors += [abs(c["predicted_s"] / c["median_s"] - 1) for c in size["configs"]
                       if c.get("candidate", True) and c["median_s"] > 0]
            points += 1
            within += choice_over_best(size) <= 1.10
            if link == "unshaped":
                harm.append(size.get("raw_again_pair_ratio",
                                     size["auto_median_s"] / size["raw_default_median_s"]))
    print("\n## Against the targets\n")
    print("| figure | measured | target |")
    print("|---|---|---|")
    if errors:
        print(f"| median prediction error | {100 * statistics.median(errors):.1f}% "
              f"({len(errors)} configurations) | <= 15% |")
    if points:
        print(f"| choice within 10% of the best measured | {within} of {points} points "
              f"({100 * within / points:.0f}%) | >= 90% |")
    if harm:
        print(f"| auto / raw, unshaped links | worst {max(harm):.3f}, median "
              f"{statistics.median(harm):.3f} ({len(harm)} points) | <= 1.05 |")


def exploration(runs):
    """The choice's two limits: whether the contenders hold a configuration within 5% of the
    best measured, and whether exploration settled within 5% of the fastest contender (both by
    this run's timing); with exploration's own agreed times where the run recorded them."""
    print("\n## Exploration: the settled choice against the fastest contender\n")
    print("| link | N | size | contenders | fastest contender | ms | settled / fastest "
          "| explored / timed here, per contender |")
    print("|---|---|---|---|---|---|---|---|")
    held, points, settled_within, explored = 0, 0, 0, 0
    for run in runs:
        link, n = label_of(None, run)
        for size in run["sizes"]:
            contenders = size.get("contenders", [])
            by_label = {c["label"]: c for c in size["configs"] if c["candidate"]}
            timed = [by_label[c] for c in contenders if c in by_label]
            if not timed:
                continue
            points += 1
            fastest = min(timed, key=lambda c: c["median_s"])
            held += fastest["median_s"] <= 1.05 * size["best_median_s"]
            if len(contenders) < 2 or size["chosen"] not in by_label:
                continue
            explored += 1
            ratio = by_label[size["chosen"]]["median_s"] / fastest["median_s"]
            settled_within += ratio <= 1.05
            own = [f"{c['explored_s'] / c['median_s']:.2f}" for c in timed
                   if "explored_s" in c and c["median_s"] > 0]
            print(f"| {link} | {n} | {size['size']} | {len(contenders)} | {fastest['label']} | "
                  f"{1e3 * fastest['median_s']:.3f} | {ratio:.3f} | {' '.join(own) or '-'} |")
    if points:
        print(f"\nThe contenders held a configuration within 5% of the best measured at {held} "
              f"of {points} points; exploration settled within 5% of the fastest contender at "
              f"{settled_within} of {explored} explored points.")


if __name__ == "__main__":
    main(sys.argv[1:])
