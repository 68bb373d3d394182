"""terse plan-pipeline: predict a pipeline's step time for each boundary compressor before a run.

    terse plan-pipeline --model mlp --link 100mbit             # calibrate, then predict
    terse plan-pipeline --profile calib.json --link 1gbit --link 100mbit \\
        --compressors none fp16 minmax8:bits=4 "ae:ratio=0.1 / none"
    python3 -m terse.plan_pipeline ...                          # the same, without the C++ tool

Calibration comes from the per-stage profiles the runtime writes (``Pipeline.profile()``) of a
short measured run: ``--profile FILE`` reads them (a JSON object with "profiles", one per stage,
and "micro_batch", optionally "measured_step_seconds" and "link" of that run, as the pipeline
benchmark (bench/pipeline_grid.py) writes under results/pipeline/calibration/; or a bare list of
profiles with ``--micro-batch``). ``--model mlp|cnn|transformer`` instead runs the pipeline
benchmark's workload uncompressed for 12 steps on loopback (4 local ranks) to measure it: those
workloads live in the benchmark harness of terse's source tree (bench/terse_harness), whose
``terse_harness.plan_pipeline`` runs this planner with them, as ``terse plan-pipeline`` of a
build tree does; the installed package alone takes ``--profile``. Each compressor's own
cost (bytes, encode and decode, autoencoder products, delta cache work) is measured here on
tensors of the boundary's size; terse.pipeline_model explains the cost model.

A compressor is a codec spec (compresses both directions), ``ae:...`` or ``delta:...``
(forward; the backward codec follows " / ", default none): see terse.pipeline.parse_compressor.
"""

import argparse
import json
import os
import sys
import tempfile
from typing import Any, Callable, Dict, List, Optional, Sequence

from terse import pipeline_model as pm

DEFAULT_COMPRESSORS = [
    "none", "fp16", "minmax8:bits=8", "minmax8:bits=4", "minmax8:bits=2", "topk:ratio=0.1",
    "randomk:ratio=0.1", "ae:ratio=0.1 / none", "delta:minmax8:bits=4 / minmax8:bits=8"]


def _split(text: str) -> List[str]:
    if " / " in text:
        fwd, bwd = text.split(" / ")
        return [fwd.strip(), bwd.strip()]
    if text.startswith("ae") or text.startswith("delta:"):
        return [text, "none"]
    return [text, text]


def load_profile(path: str, micro_batch: Optional[int]) -> Dict[str, Any]:
    with open(path) as f:
        data = json.load(f)
    if isinstance(data, list):
        if not micro_batch:
            raise SystemExit(f"{path} holds bare profiles: give --micro-batch")
        data = {"profiles": data, "micro_batch": micro_batch}
    if micro_batch:
        data["micro_batch"] = micro_batch
    missing = [k for k in ("profiles", "micro_batch") if k not in data]
    if missing:
        raise SystemExit(f"{path}: missing {', '.join(missing)}")
    return data


def main(argv: Optional[List[str]] = None, models: Sequence[str] = ("mlp", "cnn", "transformer"),
         calibrate: Optional[Callable[[str, str, List[str]], Dict[str, Any]]] = None) -> int:
    """The command. ``calibrate(model, out_dir, extra_args)`` measures one of ``models`` (the
    calibration JSON of a short uncompressed run); without it ``--model`` is refused."""
    p = argparse.ArgumentParser(prog="terse plan-pipeline",
                                description="Predicted step time and speedup of a compressed "
                                            "pipeline per boundary compressor and link rate.")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--profile", help="calibration JSON (profiles of a measured run)")
    source.add_argument("--model", choices=list(models),
                        help="calibrate now: 12 uncompressed steps of this benchmark model on "
                             "4 local ranks")
    p.add_argument("--micro-batch", type=int, help="samples per micro-batch of the profiled run")
    p.add_argument("--link", action="append", default=None,
                   help="link rate (100mbit, 1gbit, unshaped); repeat for several")
    p.add_argument("--compressors", nargs="+", default=DEFAULT_COMPRESSORS,
                   help="compressors to predict (forward[ / backward])")
    p.add_argument("--cores", type=float, default=None,
                   help="cores the stages share (default: fitted to the calibration run's "
                        "step time, at most the machine's)")
    p.add_argument("--schedule", choices=["gpipe", "1f1b"], default="gpipe")
    p.add_argument("--uncompressed-boundaries", type=int, default=0)
    p.add_argument("--json", help="write the predictions here")
    args = p.parse_args(argv)
    links = args.link or ["100mbit"]

    if args.model:
        if calibrate is None:
            p.error(f"--model {args.model}: the benchmark's workloads are in terse's source tree "
                    "(PYTHONPATH=bench python3 -m terse_harness.plan_pipeline, or terse "
                    "plan-pipeline of a build tree); give --profile FILE")
        with tempfile.TemporaryDirectory(prefix="terse-plan-") as tmp:
            print(f"calibrating: 12 uncompressed steps of {args.model} on 4 local ranks",
                  file=sys.stderr, flush=True)
            data = calibrate(args.model, tmp, [])
        data["link"] = "loopback"
    else:
        data = load_profile(args.profile, args.micro_batch)

    pairs = {c: _split(c) for c in args.compressors}
    forwards = sorted({fwd for fwd, _ in pairs.values()} | {"none"})
    backward = {fwd: bwd for fwd, bwd in pairs.values()}
    cal = pm.calibrate(data["profiles"], int(data["micro_batch"]), forwards, backward=backward,
                       measured_step_seconds=data.get("measured_step_seconds"),
                       rate_bps=pm.parse_rate(data.get("link", "unshaped")),
                       max_cores=float(os.cpu_count() or 2))
    if args.cores:
        cal.cores = args.cores
    S = len(cal.stages)
    print(f"{S} stages, {cal.micro_batches} micro-batches of {cal.micro_batch} samples, "
          f"{args.schedule}; boundaries (per sample): "
          f"{', '.join('x'.join(map(str, s)) for s in cal.sample_shapes)}; "
          f"effective cores {cal.cores:.2f}")
    out: List[Dict[str, Any]] = []
    for link in links:
        rate = pm.parse_rate(link)
        base = pm.predict(cal, "none", rate, schedule=args.schedule,
                          uncompressed_boundaries=args.uncompressed_boundaries)
        print(f"\n{link}:")
        header = (f"{'compressor':44} {'fwd B/mb':>10} {'bwd B/mb':>10} {'step ms':>9} "
                  f"{'samples/s':>10} {'speedup':>8}  bottleneck")
        print(header)
        print("-" * len(header))
        for c, (fwd, _) in pairs.items():
            r = pm.predict(cal, fwd, rate, schedule=args.schedule,
                           uncompressed_boundaries=args.uncompressed_boundaries)
            speedup = base.step_seconds / r.step_seconds
            print(f"{c:44} {r.forward_bytes:10.0f} {r.backward_bytes:10.0f} "
                  f"{1000 * r.step_seconds:9.1f} {r.samples_per_second:10.0f} "
                  f"{speedup:7.2f}x  {r.bottleneck}")
            out.append({"link": link, "compressor": c, "step_seconds": r.step_seconds,
                        "samples_per_second": r.samples_per_second, "speedup": speedup,
                        "bottleneck": r.bottleneck, "forward_bytes": r.forward_bytes,
                        "backward_bytes": r.backward_bytes})
    print("\nBytes are per micro-batch summed over the boundaries; delta compression's are its "
          "steady state (after the first epoch, which sends fp32).")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"effective_cores": cal.cores, "predictions": out}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
