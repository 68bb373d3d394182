"""The pipeline benchmark's workloads and runs: 4-stage pipelines whose boundaries are
compressed by a terse codec, a learned autoencoder or AQ-SGD's delta method, trained and
evaluated on real processes (one per stage) over loopback or the emulated cluster
(scripts/cluster.sh), started by the harness's launcher (terse_harness.launch).

``terse plan --pipeline --model M`` calibrates its cost model (terse.pipeline_model) from a short
uncompressed run of one of these workloads (:func:`calibrate_model`, through
terse_harness.plan_pipeline); the benchmark's grid and report (bench/pipeline_grid.py,
docs/pipeline.md) run every compressor on every link with :func:`launch`. Each stage process
runs ``python3 -m terse_harness.pipeline worker ...``.

Workloads (4 stages, one per emulated host): an MLP with wide hidden layers and a CNN on
Fashion-MNIST (Debian's dataset-fashion-mnist), and a small transformer on a synthetic
sequence task (which token is over-represented in a sequence of 32); their networks are the
zoo's pipeline-mlp, pipeline-cnn and pipeline-transformer (terse_harness.models).
"""
import argparse
import json
import os
import statistics
import time
from typing import Any, Dict, List, Optional, Tuple

from terse_harness import data, launch as launcher, models

# ---- models and data ------------------------------------------------------------------------

MODELS = {
    # The network (terse_harness.models) and its layers per stage; batch, micro-batches,
    # training samples per epoch, epochs, learning rate, test samples.
    "mlp": dict(network="pipeline-mlp", balance=[2, 2, 2, 1], batch=256, micro_batches=8,
                samples=10240, epochs=2, lr=0.05, test=5000),
    "cnn": dict(network="pipeline-cnn", balance=[4, 2, 3, 5], batch=128, micro_batches=8,
                samples=5120, epochs=2, lr=0.05, test=5000),
    "transformer": dict(network="pipeline-transformer", balance=[2, 1, 1, 3], batch=128,
                        micro_batches=8, samples=5120, epochs=2, lr=1e-3, test=4096),
}
# What a run's result reports as its configuration (the table above less the network).
_RUN_KEYS = ("batch", "micro_batches", "samples", "epochs", "lr", "test")


def split_compressor(text: str) -> Tuple[str, str]:
    """'fwd / bwd' -> (fwd, bwd); a plain codec compresses both directions."""
    if " / " in text:
        fwd, bwd = text.split(" / ")
        return fwd.strip(), bwd.strip()
    return text, text


def build_model(name: str):
    """Model ``name``'s network (seed 0) and its balance: layers per stage."""
    import torch

    torch.manual_seed(0)
    return models.build(MODELS[name]["network"]), MODELS[name]["balance"]


def load_data(model: str, samples: int, test: int):
    import torch

    if model == "transformer":
        x, y = data.synthetic_sequences(samples, 1)
        xt, yt = data.synthetic_sequences(test, 2)
        return x, y, xt, yt
    x, y = data.load_fashion_mnist("train", limit=samples)
    xt, yt = data.load_fashion_mnist("test", limit=test)
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
    cfg = {key: MODELS[args.model][key] for key in _RUN_KEYS}
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
        with open(os.path.join(args.out, f"{slug(compressor)}.rank{result['rank']}"), "w") as f:
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

def slug(text: str) -> str:
    return "".join(c if c.isalnum() or c in "=." else "_" for c in text).strip("_")


def launch(model: str, compressors: List[str], link: str, out: str, extra: List[str],
           stages: int = 4, timeout: float = 120) -> Dict[str, Dict[str, Any]]:
    """Runs one model's compressors on one link: 4 stage processes on loopback (`terse run`)
    or one per emulated host. Returns {compressor: cell}; a failed launch leaves the cells it
    did not finish as {"failed": output}."""
    worker_cmd = launcher.python_module(
        "terse_harness.pipeline", "worker", "--model", model, "--link", link, "--out", out,
        "--timeout", str(timeout), *extra, "--compressors", *compressors)

    def show(line: str, rank0: str) -> None:
        if "] [" in line or "failed" in line or "Error" in line:
            print("   " + line.rstrip(), flush=True)

    status, output, wall = launcher.run(worker_cmd, stages, link, timeout, on_line=show)
    cells: Dict[str, Dict[str, Any]] = {}
    for c in compressors:
        ranks = []
        for r in range(stages):
            path = os.path.join(out, f"{slug(c)}.rank{r}")
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
            cells[c] = {"failed": f"exit status {status}:\n{tail}"}
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


def main(argv: Optional[List[str]] = None) -> None:
    p = argparse.ArgumentParser(prog="python3 -m terse_harness.pipeline",
                                description="One stage process of a pipeline benchmark run "
                                            "(launch() starts them).")
    sub = p.add_subparsers(dest="command", required=True)
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
    worker(p.parse_args(argv))


if __name__ == "__main__":
    main()
