"""The pipeline benchmark: throughput and test accuracy of 4-stage pipelines whose boundaries are
compressed by each terse codec, a learned autoencoder or AQ-SGD's delta method, on real
processes (one per stage) over loopback or the emulated cluster (scripts/cluster.sh).

    python3 -m terse.pipeline_bench run [--links "unshaped 1gbit 100mbit"] [--models "mlp cnn
        transformer"] [--compressors ...] [--out results/pipeline] [--redo]
    python3 -m terse.pipeline_bench report [--out results/pipeline] [--docs docs]

``run`` is resumable: each (link, model, compressor) cell writes its own JSON and is skipped
when that file exists (``--redo`` runs it again), so the grid can be split by link rate. Before
a model's cells it calibrates the cost model (terse.pipeline_model) from a short uncompressed
run on loopback and stores the predicted step time of every cell, so every prediction is made
before the run it predicts. ``report`` prints the tables, writes summary JSON and the plots.

Models (4 stages, one per emulated host): an MLP with wide hidden layers and a CNN on
Fashion-MNIST (Debian's dataset-fashion-mnist), and a small transformer on a synthetic
sequence task (which token is over-represented in a sequence of 32).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any, Dict, List, Optional, Tuple

# ---- models and data ------------------------------------------------------------------------

MODELS = {
    # batch, micro-batches, training samples per epoch, epochs, learning rate, test samples
    "mlp": dict(batch=256, micro_batches=8, samples=10240, epochs=2, lr=0.05, test=5000),
    "cnn": dict(batch=128, micro_batches=8, samples=5120, epochs=2, lr=0.05, test=5000),
    "transformer": dict(batch=128, micro_batches=8, samples=5120, epochs=2, lr=1e-3, test=4096),
}

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
MLP_WIDTH = 1024
VOCAB, SEQ, D_MODEL = 16, 32, 64


def compressors_for(model: str) -> List[str]:
    return CODECS + EXTRA[model]


def split_compressor(text: str) -> Tuple[str, str]:
    """'fwd / bwd' -> (fwd, bwd); a plain codec compresses both directions."""
    if " / " in text:
        fwd, bwd = text.split(" / ")
        return fwd.strip(), bwd.strip()
    return text, text


def build_model(name: str):
    import torch
    from torch import nn

    torch.manual_seed(0)
    if name == "mlp":
        w = MLP_WIDTH
        return nn.Sequential(nn.Linear(784, w), nn.ReLU(), nn.Linear(w, w), nn.ReLU(),
                             nn.Linear(w, w), nn.ReLU(), nn.Linear(w, 10)), [2, 2, 2, 1]
    if name == "cnn":
        return nn.Sequential(
            nn.Unflatten(1, (1, 28, 28)), nn.Conv2d(1, 16, 5, padding=2), nn.ReLU(),
            nn.MaxPool2d(2),                                   # boundary 0: [16, 14, 14]
            nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(),        # boundary 1: [32, 14, 14]
            nn.MaxPool2d(2), nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(),  # 2: [64, 7, 7]
            nn.MaxPool2d(2), nn.Flatten(), nn.Linear(64 * 9, 128), nn.ReLU(),
            nn.Linear(128, 10)), [4, 2, 3, 5]
    if name == "transformer":
        layers = [_Embedding()] + [
            nn.TransformerEncoderLayer(D_MODEL, 4, 4 * D_MODEL, dropout=0.0, batch_first=True)
            for _ in range(4)] + [_MeanPool(), nn.Linear(D_MODEL, VOCAB)]
        return nn.Sequential(*layers), [2, 1, 1, 3]
    raise ValueError(f"unknown model {name}")


def _embedding_class():
    import torch
    from torch import nn

    class Embedding(nn.Module):
        """Token plus learned position embeddings: int64 [batch, SEQ] -> [batch, SEQ, D]."""

        def __init__(self) -> None:
            super().__init__()
            self.tokens = nn.Embedding(VOCAB, D_MODEL)
            self.positions = nn.Parameter(torch.randn(SEQ, D_MODEL) * 0.1)

        def forward(self, x):
            return self.tokens(x) + self.positions

    class MeanPool(nn.Module):
        def forward(self, x):
            return x.mean(1)

    return Embedding, MeanPool


def _Embedding():
    return _embedding_class()[0]()


def _MeanPool():
    return _embedding_class()[1]()


def synthetic_sequences(n: int, seed: int):
    """Sequences of SEQ tokens, uniform over VOCAB except one class token drawn with extra
    probability 0.08 per position; the label is that token (the Bayes error is well above
    zero, so accuracy tracks how well the model counts)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, VOCAB, (n,), generator=g)
    tokens = torch.randint(0, VOCAB, (n, SEQ), generator=g)
    boost = torch.rand(n, SEQ, generator=g) < 0.08
    tokens = torch.where(boost, labels[:, None].expand(n, SEQ), tokens)
    return tokens, labels


def load_data(model: str, samples: int, test: int):
    import torch

    if model == "transformer":
        x, y = synthetic_sequences(samples, 1)
        xt, yt = synthetic_sequences(test, 2)
        return x, y, xt, yt
    from terse.data import load_fashion_mnist

    x, y = load_fashion_mnist("train", limit=samples)
    xt, yt = load_fashion_mnist("test", limit=test)
    return (torch.from_numpy(x), torch.from_numpy(y), torch.from_numpy(xt),
            torch.from_numpy(yt))


# ---- one rank -------------------------------------------------------------------------------

WARMUP_STEPS = 3  # excluded from timing: first touch of buffers, the autoencoder's setup
AE_WARMUP_STEPS = 10  # uncompressed steps before an autoencoder takes over (PCA init)


def worker(args: argparse.Namespace) -> None:
    """One rank: trains and evaluates one pipeline per compressor, one after the other in the
    same processes (so a link's cells share the start-up), writing OUT/<slug>.rank<R>."""
    import torch

    import terse

    torch.set_num_threads(1)
    cfg = dict(MODELS[args.model])
    for key in ("samples", "epochs", "micro_batches", "batch", "test"):
        if getattr(args, key, None):
            cfg[key] = getattr(args, key)
    x, y, xt, yt = load_data(args.model, cfg["samples"], cfg["test"])
    for compressor in args.compressors:
        try:
            result = run_one(args, cfg, compressor, x, y, xt, yt)
        except terse.Error as e:
            # Training diverged (a codec refused NaN) or a stage failed: every stage gets an
            # error (the pipeline fails its communicator) and goes on to the next compressor
            # with a fresh pipeline.
            result = {"rank": int(os.environ.get("RANK", 0)), "compressor": compressor,
                      "failed": f"{type(e).__name__}: {e}"}
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"{_slug(compressor)}.rank{result['rank']}"), "w") as f:
            json.dump(result, f)


def run_one(args: argparse.Namespace, cfg: Dict[str, Any], compressor: str, x, y, xt, yt
            ) -> Dict[str, Any]:
    import terse
    import terse.torch

    started = time.perf_counter()
    model, balance = build_model(args.model)
    fwd, bwd = split_compressor(compressor)
    warmup = args.warmup_steps
    if fwd.startswith("ae"):
        # The autoencoder starts from the principal components of warm-up activations; from a
        # random projection it learned nothing in this budget (CNN: 10 % test accuracy).
        warmup = max(warmup, AE_WARMUP_STEPS)
    pipe = terse.torch.pipeline(model, balance=balance, micro_batches=cfg["micro_batches"],
                                forward=fwd, backward=bwd, schedule=args.schedule,
                                uncompressed_boundaries=args.uncompressed_boundaries,
                                warmup_steps=warmup, timeout=args.timeout)
    try:
        return train_one(args, cfg, compressor, pipe, warmup, started, x, y, xt, yt)
    except BaseException:
        try:
            pipe.close()  # its communicator failed: pending messages fail at once
        except terse.Error:
            pass
        raise


def train_one(args: argparse.Namespace, cfg: Dict[str, Any], compressor: str, pipe: Any,
              warmup: int, started: float, x, y, xt, yt) -> Dict[str, Any]:
    import gc

    import torch

    pipe.setup(x[:2])
    params = list(pipe.parameters())
    if args.model == "transformer":
        optimizer = torch.optim.Adam(params, lr=cfg["lr"])
    else:
        optimizer = torch.optim.SGD(params, lr=cfg["lr"], momentum=0.9)
    batch = cfg["batch"]
    steps_per_epoch = cfg["samples"] // batch
    step_starts: List[float] = []
    epoch_steps: List[int] = []
    losses: List[float] = []
    setup_seconds = time.perf_counter() - started
    step = 0
    label = f"{args.link} {args.model} {compressor}"
    for epoch in range(cfg["epochs"]):
        epoch_steps.append(step)
        order = torch.randperm(len(x), generator=torch.Generator().manual_seed(epoch))
        for i in range(steps_per_epoch):
            if step == max(WARMUP_STEPS, warmup):
                pipe.reset_profile()
            step_starts.append(time.perf_counter())
            index = order[i * batch:(i + 1) * batch]
            with pipe.measure("optimizer"):
                optimizer.zero_grad()
            loss = pipe.step(x[index] if pipe.is_first else None,
                             y[index] if pipe.is_last else None,
                             indices=index if pipe.is_first else None)
            with pipe.measure("optimizer"):
                optimizer.step()
            if loss is not None:
                losses.append(loss)
            step += 1
            if pipe.is_last and args.progress and step % max(1, steps_per_epoch // 2) == 0:
                print(f"[{label}] epoch {epoch + 1} step {step} loss "
                      f"{statistics.mean(losses[-10:]):.3f}", flush=True)
    step_starts.append(time.perf_counter())
    profile = pipe.profile()
    eval_started = time.perf_counter()
    correct = 0
    with torch.no_grad():
        for start in range(0, len(xt), 1000):
            out = pipe.predict(xt[start:start + 1000] if pipe.is_first else None)
            if out is not None:
                correct += int((out.argmax(1) == yt[start:start + 1000]).sum())
    result = {
        "rank": pipe.rank, "stage": pipe.stage, "model": args.model,
        "compressor": compressor, "link": args.link, "config": cfg,
        "schedule": args.schedule, "step_starts": step_starts, "epoch_steps": epoch_steps,
        "losses": losses, "profile": profile, "bytes_sent": pipe.bytes_sent,
        "setup_seconds": setup_seconds, "eval_seconds": time.perf_counter() - eval_started,
        "test_accuracy": correct / len(xt) if pipe.is_last else None,
    }
    pipe.close()
    del pipe, optimizer, params
    gc.collect()
    return result


# ---- the driver -----------------------------------------------------------------------------

def _slug(text: str) -> str:
    return "".join(c if c.isalnum() or c in "=." else "_" for c in text).strip("_")


def _env() -> Dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (package_root, os.environ.get("PYTHONPATH", "")) if p)
    return env


def launch(model: str, compressors: List[str], link: str, out: str, extra: List[str],
           stages: int = 4, timeout: float = 120) -> Dict[str, Dict[str, Any]]:
    """Runs one model's compressors on one link: 4 stage processes on loopback (`terse run`)
    or one per emulated host. Returns {compressor: cell}; a failed launch leaves the cells it
    did not finish as {"failed": output}."""
    from terse import _paths

    env = _env()
    worker_cmd = [sys.executable, "-m", "terse.pipeline_bench", "worker", "--model", model,
                  "--link", link, "--out", out, "--timeout", str(timeout), *extra,
                  "--compressors", *compressors]
    if link in ("loopback", "local"):
        cmd = [_paths.TERSE_CLI, "run", "-n", str(stages), "--timeout", str(timeout), "--",
               *worker_cmd]
    else:
        cluster = _paths.CLUSTER_SCRIPT
        cmd = ["bash", cluster, "-n", str(stages), "-r", link, "--", "env",
               f"PYTHONPATH={env['PYTHONPATH']}", "OMP_NUM_THREADS=1", "PYTHONUNBUFFERED=1",
               f"TERSE_TIMEOUT={timeout}", *worker_cmd]
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    output: List[str] = []
    for line in proc.stdout:
        output.append(line)
        if "] [" in line or "failed" in line or "Error" in line:
            print("   " + line.rstrip(), flush=True)
    proc.wait()
    wall = time.perf_counter() - started
    cells: Dict[str, Dict[str, Any]] = {}
    for c in compressors:
        ranks = []
        for r in range(stages):
            path = os.path.join(out, f"{_slug(c)}.rank{r}")
            if os.path.exists(path):
                with open(path) as f:
                    ranks.append(json.load(f))
                os.remove(path)
        failures = [r["failed"] for r in ranks if "failed" in r]
        if failures:
            # The stage that met the error first names it; the others report its abort.
            first = next((f for f in failures if f.startswith("InvalidArgument")), failures[0])
            cells[c] = {"failed": first, "diverged": "NaN" in " ".join(failures)}
        elif len(ranks) == stages:
            cells[c] = summarize(ranks, wall)
        else:
            tail = "".join(output[-30:])
            cells[c] = {"failed": f"exit status {proc.returncode}:\n{tail}"}
    return cells


def timed_after(timed: List[float], first: Dict[str, Any]) -> List[float]:
    if first["compressor"].startswith("ae"):
        return timed[max(0, AE_WARMUP_STEPS - WARMUP_STEPS):] or timed
    return timed


def summarize(ranks: List[Dict[str, Any]], wall: float) -> Dict[str, Any]:
    """One cell's figures from its ranks' results: medians of per-step times."""
    ranks = sorted(ranks, key=lambda r: r["stage"])
    first, last = ranks[0], ranks[-1]
    starts = first["step_starts"]
    steps = [b - a for a, b in zip(starts, starts[1:])]
    cfg = first["config"]
    timed = steps[WARMUP_STEPS:]
    second_epoch = first["epoch_steps"][1] if len(first["epoch_steps"]) > 1 else None
    later = steps[second_epoch:] if second_epoch is not None else []
    return {
        "model": first["model"], "compressor": first["compressor"], "link": first["link"],
        "schedule": first["schedule"], "config": cfg,
        # Autoencoder cells time the steps after their warm-up.
        "median_step_seconds": statistics.median(timed_after(timed, first)),
        "samples_per_second": cfg["batch"] / statistics.median(timed_after(timed, first)),
        # Delta compression sends fp32 in the first epoch: its later epochs are its steady state.
        "median_step_seconds_after_epoch1": statistics.median(later) if later else None,
        "samples_per_second_after_epoch1": cfg["batch"] / statistics.median(later)
        if later else None,
        "train_seconds": starts[-1] - starts[0],
        "samples_per_second_whole_run": len(steps) * cfg["batch"] / (starts[-1] - starts[0]),
        "test_accuracy": last["test_accuracy"],
        "final_loss": statistics.mean(last["losses"][-10:]),
        "losses": last["losses"],
        # Training traffic only (the profile's window: after the warm-up steps, before the
        # evaluation), per stage.
        "bytes_sent_per_step": [sum(r["profile"]["bytes_per_step"].values()) for r in ranks],
        "profiles": [r["profile"] for r in ranks],
        "launch_wall_seconds": wall,
        "setup_seconds": max(r["setup_seconds"] for r in ranks),
        "eval_seconds": max(r["eval_seconds"] for r in ranks),
    }


def calibrate_model(model: str, out_dir: str, extra: List[str]) -> Dict[str, Any]:
    """A short uncompressed run on loopback whose per-stage profiles calibrate the model."""
    path = os.path.join(out_dir, "calibration", f"{model}.json")
    if os.path.exists(path):
        with open(path) as f:
            return json.load(f)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    batch = MODELS[model]["batch"]
    cell = launch(model, ["none"], "loopback", os.path.join(out_dir, "calibration", model),
                  ["--samples", str(batch * 12), "--epochs", "1", *extra])["none"]
    if "failed" in cell:
        raise RuntimeError(f"calibration run of {model} failed: {cell['failed']}")
    data = {"model": model, "profiles": cell["profiles"],
            "micro_batch": batch // cell["config"]["micro_batches"],
            "measured_step_seconds": cell["median_step_seconds"]}
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
    return data


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
        raise SystemExit("pipeline_bench: emulated links need root (network namespaces, tc)")
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
            paths = {c: os.path.join(args.out, link, model, _slug(c) + suffix)
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
    p = argparse.ArgumentParser(prog="python3 -m terse.pipeline_bench",
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
    w = sub.add_parser("worker", help=argparse.SUPPRESS)
    w.add_argument("--model", required=True)
    w.add_argument("--compressors", nargs="+", required=True)
    w.add_argument("--link", default="loopback")
    w.add_argument("--out", required=True)
    w.add_argument("--timeout", type=float, default=120)
    w.add_argument("--schedule", default="gpipe")
    w.add_argument("--samples", type=int)
    w.add_argument("--epochs", type=int)
    w.add_argument("--test", type=int)
    w.add_argument("--micro-batches", dest="micro_batches", type=int)
    w.add_argument("--batch", type=int)
    w.add_argument("--uncompressed-boundaries", dest="uncompressed_boundaries", type=int,
                   default=0)
    w.add_argument("--warmup-steps", dest="warmup_steps", type=int, default=0)
    w.add_argument("--label", default="")
    w.add_argument("--progress", action="store_true")
    args = p.parse_args(argv)
    if args.command == "worker":
        worker(args)
    elif args.command == "run":
        run_grid(args)
    else:
        report(args)


if __name__ == "__main__":
    main()
