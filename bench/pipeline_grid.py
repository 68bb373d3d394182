"""The pipeline benchmark's grid and report (docs/pipeline.md): throughput and test accuracy of
4-stage pipelines whose boundaries are compressed by each terse codec, a learned autoencoder or
AQ-SGD's delta method, per model and link rate. The models and the stage processes are
terse_harness.pipeline's (beside this script); bench/pipeline.sh runs it with the build tree's
terse on PYTHONPATH.

    python3 bench/pipeline_grid.py run [--links "unshaped 1gbit 100mbit"] [--models "mlp cnn
        transformer"] [--compressors ...] [--out results/pipeline] [--redo]
    python3 bench/pipeline_grid.py report [--out results/pipeline] [--docs docs]

``run`` is resumable: each (link, model, compressor) cell writes its own JSON and is skipped
when that file exists (``--redo`` runs it again), so the grid can be split by link rate. Before
a model's cells it calibrates the cost model (terse.pipeline_model) from a short uncompressed
run on loopback and stores the predicted step time of every cell, so every prediction is made
before the run it predicts. ``report`` prints the tables, writes summary JSON and the plots.
"""

import argparse
import json
import os
import statistics
import time
from typing import Any, Dict, List, Optional, Tuple

from terse_harness.pipeline import MODELS, calibrate_model, launch, slug, split_compressor

# Compressors per model: the backward (gradient) codec follows after " / ".
CODECS = ["none", "fp16", "minmax8:bits=8", "minmax8:bits=4", "minmax8:bits=2",
          "topk:ratio=0.1", "randomk:ratio=0.1"]
EXTRA = {
    "mlp": ["ae:ratio=0.1 / none", "delta:minmax8:bits=4 / minmax8:bits=8",
            "delta:minmax8:bits=2 / minmax8:bits=8"],
    "cnn": ["ae:ratio=0.25,dim=1 / none", "delta:minmax8:bits=4 / minmax8:bits=8",
            "delta:minmax8:bits=2 / minmax8:bits=8"],
    "transformer": ["ae:ratio=0.25 / none", "delta:minmax8:bits=4 / minmax8:bits=8",
                    "delta:minmax8:bits=2 / minmax8:bits=8"],
}


def compressors_for(model: str) -> List[str]:
    return CODECS + EXTRA[model]


def predictions_for(model: str, calibration: Dict[str, Any], links: List[str],
                    compressors: List[str], out_dir: str,
                    recompute: bool = False) -> Dict[str, Dict[str, Any]]:
    """Predicted step times of every cell from the model's calibration run (made before the
    cells), stored beside it. recompute: again with the current cost model and fresh
    micro-benchmarks of the compressors, replacing what is stored."""
    from terse import pipeline_model as pm

    path = os.path.join(out_dir, "calibration", f"{model}-predictions.json")
    stored: Dict[str, Dict[str, Any]] = {}
    if os.path.exists(path) and not recompute:
        with open(path) as f:
            stored = json.load(f)
    missing = [(link, c) for link in links for c in compressors if f"{link}|{c}" not in stored]
    if missing:
        need = sorted({c for _, c in missing})
        backward = {c: split_compressor(c)[1] for c in need}
        forward = {c: split_compressor(c)[0] for c in need}
        cal = pm.calibrate(calibration["profiles"], calibration["micro_batch"],
                           sorted(set(forward.values())),
                           backward={forward[c]: backward[c] for c in need},
                           measured_step_seconds=calibration["measured_step_seconds"])
        for link, c in missing:
            p = pm.predict(cal, forward[c], pm.parse_rate(link))
            stored[f"{link}|{c}"] = {"step_seconds": p.step_seconds,
                                     "samples_per_second": p.samples_per_second,
                                     "bottleneck": p.bottleneck,
                                     "forward_bytes": p.forward_bytes,
                                     "backward_bytes": p.backward_bytes,
                                     "effective_cores": cal.cores}
        with open(path, "w") as f:
            json.dump(stored, f, indent=1)
    return stored


def _done(path: str) -> bool:
    """A cell is done when its JSON exists and is not a failed launch; a diverged run (NaN) is
    a result, a crash of the launch is not."""
    if not os.path.exists(path):
        return False
    with open(path) as f:
        cell = json.load(f)
    return "failed" not in cell or bool(cell.get("diverged"))


def run_grid(args: argparse.Namespace) -> None:
    links = args.links.split()
    models = args.models.split()
    if any(link not in ("loopback", "local") for link in links) and os.geteuid() != 0:
        raise SystemExit("pipeline_grid: emulated links need root (network namespaces, tc)")
    extra = ["--schedule", args.schedule]
    for key in ("samples", "epochs", "test"):
        if getattr(args, key):
            extra += [f"--{key}", str(getattr(args, key))]
    total_started = time.perf_counter()
    for model in models:
        compressors = args.compressors or compressors_for(model)
        calibration = calibrate_model(model, args.out, [])
        predictions_for(model, calibration, links, compressors, args.out)
        if args.rep % 2 == 0:
            # Another repetition in the opposite order, so that a burst of load from other
            # work on the machine falls on different cells.
            compressors = compressors[::-1]
        suffix = ".json" if args.rep == 1 else f".rep{args.rep}.json"
        for link in links:
            paths = {c: os.path.join(args.out, link, model, slug(c) + suffix)
                     for c in compressors}
            todo = [c for c in compressors if args.redo or not _done(paths[c])]
            if not todo:
                continue
            os.makedirs(os.path.join(args.out, link, model), exist_ok=True)
            print(f"== {model} on {link}: {', '.join(todo)}", flush=True)
            cells = launch(model, todo, link, os.path.join(args.out, link, model, "ranks"),
                           extra + (["--progress"] if args.progress else []))
            for c in todo:
                cell = cells[c]
                cell.update(model=model, compressor=c, link=link, label=f"{link} {model} {c}",
                            rep=args.rep)
                with open(paths[c], "w") as f:
                    json.dump(cell, f)
                if "failed" in cell:
                    print(f"   {c}: FAILED", flush=True)
                else:
                    print(f"   {c}: {cell['samples_per_second']:.0f} samples/s, step "
                          f"{1000 * cell['median_step_seconds']:.1f} ms, test accuracy "
                          f"{100 * cell['test_accuracy']:.2f} % (total "
                          f"{time.perf_counter() - total_started:.0f} s)", flush=True)


# ---- the report -----------------------------------------------------------------------------

LINK_ORDER = ["loopback", "unshaped", "10gbit", "1gbit", "100mbit"]


def load_cells(out_dir: str) -> List[Dict[str, Any]]:
    cells = []
    for root, _, files in os.walk(out_dir):
        if os.path.basename(root) == "calibration":
            continue
        for name in files:
            if name.endswith(".json"):
                with open(os.path.join(root, name)) as f:
                    cell = json.load(f)
                if "model" in cell and "compressor" in cell:
                    cells.append(cell)
    return cells


def combine_reps(cells: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """One cell per (link, model, compressor): step times are the median over repetitions of
    each repetition's median step; accuracy and bytes come from the first repetition (training
    is deterministic, so repetitions reach the same accuracy; a difference is reported)."""
    groups: Dict[Tuple[str, str, str], List[Dict[str, Any]]] = {}
    for c in cells:
        groups.setdefault((c["link"], c["model"], c["compressor"]), []).append(c)
    out = []
    for reps in groups.values():
        reps.sort(key=lambda c: c.get("rep", 1))
        cell = dict(reps[0])
        cell["reps"] = len(reps)
        for key in ("median_step_seconds", "median_step_seconds_after_epoch1"):
            values = [c[key] for c in reps if c.get(key)]
            cell[key] = statistics.median(values) if values else None
            cell[key + "_per_rep"] = values
        batch = cell["config"]["batch"]
        cell["samples_per_second"] = batch / cell["median_step_seconds"]
        if cell["median_step_seconds_after_epoch1"]:
            cell["samples_per_second_after_epoch1"] = (
                batch / cell["median_step_seconds_after_epoch1"])
        cell["accuracy_per_rep"] = [c["test_accuracy"] for c in reps]
        out.append(cell)
    return out


def report(args: argparse.Namespace) -> None:
    cells = combine_reps([c for c in load_cells(args.out) if "failed" not in c])
    failed = [c for c in load_cells(args.out) if "failed" in c]
    predictions: Dict[str, Dict[str, Any]] = {}
    for model in MODELS:
        calibration = os.path.join(args.out, "calibration", f"{model}.json")
        if not os.path.exists(calibration):
            continue
        with open(calibration) as f:
            cal = json.load(f)
        mine = [c for c in cells if c["model"] == model]
        predictions[model] = predictions_for(
            model, cal, sorted({c["link"] for c in mine}), sorted({c["compressor"] for c in mine}),
            args.out, recompute=args.repredict)
    lines: List[str] = []
    summary: List[Dict[str, Any]] = []
    errors: List[float] = []
    for model in MODELS:
        for link in sorted({c["link"] for c in cells if c["model"] == model},
                           key=lambda l: LINK_ORDER.index(l) if l in LINK_ORDER else 99):
            rows = [c for c in cells if c["model"] == model and c["link"] == link]
            order = compressors_for(model)
            rows.sort(key=lambda c: order.index(c["compressor"]) if c["compressor"] in order
                      else 99)
            base = next((c for c in rows if c["compressor"] == "none"), None)
            lines.append(f"\n### {model}, {link}\n")
            lines.append("| compressor (fwd / bwd) | samples/s | vs none | after epoch 1 | "
                         "test acc. % | vs none (points) | bytes/step (stage 0) | "
                         "predicted step ms | measured step ms | error |")
            lines.append("|---|---|---|---|---|---|---|---|---|---|")
            for c in rows:
                pred = predictions.get(model, {}).get(f"{link}|{c['compressor']}")
                ratio = c["samples_per_second"] / base["samples_per_second"] if base else None
                d_acc = (100 * (c["test_accuracy"] - base["test_accuracy"]) if base else None)
                later = c.get("samples_per_second_after_epoch1")
                err = None
                # Delta's prediction is its steady state: the steps after its fp32 first epoch.
                measured = (c.get("median_step_seconds_after_epoch1")
                            if c["compressor"].startswith("delta") else None)
                measured = measured or c["median_step_seconds"]
                if pred:
                    err = pred["step_seconds"] / measured - 1
                    errors.append(abs(err))
                row = {"model": model, "link": link, "compressor": c["compressor"],
                       "samples_per_second": c["samples_per_second"],
                       "speedup_vs_none": ratio,
                       "samples_per_second_after_epoch1": later,
                       "test_accuracy": c["test_accuracy"],
                       "accuracy_vs_none_points": d_acc,
                       "median_step_seconds": c["median_step_seconds"],
                       "median_step_seconds_per_rep": c["median_step_seconds_per_rep"],
                       "accuracy_per_rep": c["accuracy_per_rep"],
                       "compared_step_seconds": measured,
                       "predicted_step_seconds": pred["step_seconds"] if pred else None,
                       "prediction_error": err,
                       "bytes_sent_per_step_stage0": c["bytes_sent_per_step"][0]}
                summary.append(row)
                cells_text = [
                    c["compressor"], f"{c['samples_per_second']:.0f}",
                    "" if ratio is None else f"{ratio:.2f}x",
                    "" if later is None else f"{later:.0f}",
                    f"{100 * c['test_accuracy']:.2f}",
                    "" if d_acc is None else f"{d_acc:+.2f}",
                    f"{c['bytes_sent_per_step'][0] / 1e6:.3f} MB",
                    "" if not pred else f"{1000 * pred['step_seconds']:.0f}",
                    f"{1000 * measured:.0f}",
                    "" if err is None else f"{100 * err:+.0f} %"]
                lines.append("| " + " | ".join(cells_text) + " |")
            for c in failed:
                if c["model"] == model and c["link"] == link and c.get("rep", 1) == 1:
                    what = "diverged (NaN)" if c.get("diverged") else "failed"
                    lines.append(f"| {c['compressor']} | | | | {what} | | | | | |")
    if errors:
        lines.append(f"\nPrediction error over {len(errors)} cells: median "
                     f"{100 * statistics.median(errors):.1f} %, max {100 * max(errors):.1f} %.")
        for link in LINK_ORDER:
            mine = [abs(r["prediction_error"]) for r in summary
                    if r["link"] == link and r["prediction_error"] is not None]
            if mine:
                lines.append(f"- {link}: median {100 * statistics.median(mine):.1f} % over "
                             f"{len(mine)} cells")
    # How far repetitions of the same cell land apart: the noise floor of any prediction here.
    spreads = [abs(a - b) / ((a + b) / 2) for c in cells
               if len(c["median_step_seconds_per_rep"]) >= 2
               for a, b in [c["median_step_seconds_per_rep"][:2]]]
    if spreads:
        lines.append(f"\nRepetitions of the same cell differ by a median of "
                     f"{100 * statistics.median(spreads):.1f} % in median step time (max "
                     f"{100 * max(spreads):.1f} %, {len(spreads)} cells).")
    for c in failed:
        what = "diverged" if c.get("diverged") else "FAILED"
        if c.get("rep", 1) == 1:
            lines.append(f"\n{what}: {c['link']} {c['model']} {c['compressor']}: "
                         f"{c['failed'].splitlines()[0]}")
    text = "\n".join(lines)
    print(text)
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump({"cells": summary,
                   "median_abs_prediction_error": statistics.median(errors) if errors else None},
                  f, indent=1)
    with open(os.path.join(args.out, "tables.md"), "w") as f:
        f.write(text + "\n")
    plot(summary, args.docs)


def plot(summary: List[Dict[str, Any]], docs: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing (Debian python3-matplotlib): no plots")
        return
    os.makedirs(docs, exist_ok=True)
    for model in MODELS:
        rows = [r for r in summary if r["model"] == model]
        if not rows:
            continue
        links = sorted({r["link"] for r in rows},
                       key=lambda l: LINK_ORDER.index(l) if l in LINK_ORDER else 99)
        fig, axes = plt.subplots(1, len(links), figsize=(5 * len(links), 4.5), squeeze=False)
        for ax, link in zip(axes[0], links):
            for r in rows:
                if r["link"] != link:
                    continue
                ax.scatter(r["samples_per_second"], 100 * r["test_accuracy"],
                           marker="*" if r["compressor"] == "none" else "o")
                ax.annotate(r["compressor"].split(" / ")[0], (r["samples_per_second"],
                                                               100 * r["test_accuracy"]),
                            fontsize=7)
            ax.set_title(f"{model}, {link}")
            ax.set_xlabel("samples/s (median step)")
            ax.set_ylabel("test accuracy (%)")
            ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(os.path.join(docs, f"pipeline-{model}.png"), dpi=110)
        plt.close(fig)
    pred = [r for r in summary if r["predicted_step_seconds"]]
    if pred:
        fig, ax = plt.subplots(figsize=(5, 5))
        for link in sorted({r["link"] for r in pred}):
            pts = [r for r in pred if r["link"] == link]
            ax.scatter([1000 * r["compared_step_seconds"] for r in pts],
                       [1000 * r["predicted_step_seconds"] for r in pts], label=link, s=12)
        top = max(1000 * max(r["compared_step_seconds"], r["predicted_step_seconds"])
                  for r in pred)
        ax.plot([1, top], [1, top], "k--", lw=0.8)
        ax.plot([1, top], [1.15, 1.15 * top], "k:", lw=0.6)
        ax.plot([1, top], [0.85, 0.85 * top], "k:", lw=0.6)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("measured step (ms)")
        ax.set_ylabel("predicted step (ms)")
        ax.legend()
        ax.set_title("pipeline cost model (dotted: ±15 %)")
        fig.tight_layout()
        fig.savefig(os.path.join(docs, "pipeline-model.png"), dpi=110)
        plt.close(fig)


def main(argv: Optional[List[str]] = None) -> None:
    p = argparse.ArgumentParser(prog="bench/pipeline_grid.py",
                                description=" ".join(__doc__.split("\n\n")[0].split()))
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="run (or resume) the grid")
    r.add_argument("--links", default="unshaped 1gbit 100mbit")
    r.add_argument("--models", default=" ".join(MODELS))
    r.add_argument("--compressors", nargs="*", default=None)
    r.add_argument("--schedule", default="gpipe")
    r.add_argument("--out", default="results/pipeline")
    r.add_argument("--redo", action="store_true")
    r.add_argument("--rep", type=int, default=1,
                   help="repetition number: 2, 3, ... run the grid again (even ones in reverse "
                        "order) into separate files; the report takes medians over them")
    r.add_argument("--progress", action="store_true")
    r.add_argument("--samples", type=int, help="training samples per epoch (default per model)")
    r.add_argument("--epochs", type=int, help="epochs (default per model)")
    r.add_argument("--test", type=int, help="test samples (default per model)")
    rep = sub.add_parser("report", help="tables, JSON and plots from the results")
    rep.add_argument("--out", default="results/pipeline")
    rep.add_argument("--docs", default="docs")
    rep.add_argument("--repredict", action="store_true",
                     help="recompute the predictions from the stored calibration runs with the "
                          "current cost model")
    args = p.parse_args(argv)
    if args.command == "run":
        run_grid(args)
    else:
        report(args)


if __name__ == "__main__":
    main()
