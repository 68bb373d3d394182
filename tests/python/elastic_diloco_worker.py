"""A worker of test_elastic_diloco.py: the Fashion-MNIST MLP trained with
terse.elastic.ElasticDiLoCo under `terse run --elastic`, logging one line per applied outer step.

    terse run --elastic --max-restarts 1 -n 4 -- python elastic_diloco_worker.py --steps 128 \\
        --kill-slot 2 --kill-step 10

Options: --kill-slot/--kill-step: that slot SIGKILLs itself before that inner step (in its first
incarnation only); --stop-slot/--stop-step/--stop-seconds: that slot stops itself (SIGSTOP)
before that inner step, or the first after it once a worker was taken in when --kill-slot is
given, and a helper process wakes it (SIGCONT) after the given seconds;
--mismatch-slot: that slot constructs with sync_every + 1; --codec, --sync-every.
Lines: "STARTED slot K pid P at T" first, "APPLIED outer O pid P gen G size N trained C at T
digest D" after each applied outer step (D: the global parameters), "EVENT {...}" per
re-forming, "FINAL steps S outer O digest D loss L" at the end.
"""

import time

STARTED = time.time()  # before the imports below, which take seconds

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import re  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402

import torch  # noqa: E402

import terse.elastic  # noqa: E402
from elastic_worker import global_batch, stop_self  # noqa: E402
from fashion_mlp import data, digest, make_model  # noqa: E402

def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=128)
    ap.add_argument("--sync-every", type=int, default=4)
    ap.add_argument("--codec", default="none")
    ap.add_argument("--kill-slot", type=int, default=-1)
    ap.add_argument("--kill-step", type=int, default=-1)
    ap.add_argument("--stop-slot", type=int, default=-1)
    ap.add_argument("--stop-step", type=int, default=-1)
    ap.add_argument("--stop-seconds", type=float, default=0)
    ap.add_argument("--mismatch-slot", type=int, default=-1)
    ap.add_argument("--settle", type=float, default=1.5)
    ap.add_argument("--lr", type=float, default=3e-3, help="the inner AdamW's")
    ap.add_argument("--step-seconds", type=float, default=0,
                    help="sleep this long in each inner step (compute a restarted worker "
                         "overlaps)")
    args = ap.parse_args()

    torch.set_num_threads(1)
    slot = int(os.environ["RANK"])
    print(f"STARTED slot {slot} pid {os.getpid()} at {STARTED:.3f}", flush=True)
    first = int(os.environ.get("TERSE_RESTART_COUNT", "0")) == 0
    model = make_model()
    inner = torch.optim.AdamW(model.parameters(), lr=args.lr)

    applied_by = []  # the generation of each outer step this worker applied

    def log(text: str) -> None:
        print(f"LOG slot {slot}: {text}", flush=True)
        m = re.match(r"outer step (\d+) applied by generation (\d+) \((\d+) members, (\d+) "
                     r"trained", text)
        if m:  # with mixing 0 the model holds the global parameters after an outer step
            applied_by.append(int(m.group(2)))
            print(f"APPLIED outer {m.group(1)} pid {os.getpid()} gen {m.group(2)} size "
                  f"{m.group(3)} trained {m.group(4)} at {time.time():.3f} digest "
                  f"{digest(model.parameters())}", flush=True)

    sync_every = args.sync_every + (1 if slot == args.mismatch_slot else 0)
    job = terse.elastic.ElasticDiLoCo(model, inner, sync_every=sync_every, codec=args.codec,
                                      settle=args.settle, threads=1, log=log)
    loss_fn = torch.nn.CrossEntropyLoss()
    while job.steps < args.steps:
        x, y = job.split(*global_batch(job.steps))
        job.zero_grad()
        loss_fn(model(x), y).backward()
        time.sleep(args.step_seconds)
        if first and slot == args.kill_slot and job.steps == args.kill_step:
            os.kill(os.getpid(), signal.SIGKILL)
        # The stop waits until an outer step was applied with the worker that the first join
        # took in (the replacement of --kill-slot, when there is one), so that the two faults
        # do not overlap.
        joins = [e["generation"] for e in job.events if e["why"] == "join"]
        joined = args.kill_slot < 0 or (joins != [] and max(applied_by, default=0) >= joins[0])
        if first and slot == args.stop_slot and job.steps >= args.stop_step and joined:
            first = False
            stop_self(args.stop_seconds)
        job.step()
    job.finish()
    for event in job.events:
        print("EVENT " + json.dumps(event), flush=True)
    x, y = data()  # all 2,048 samples
    with torch.no_grad():
        final = float(loss_fn(model(x), y))
    print(f"FINAL steps {job.steps} outer {job.outer_steps} digest {digest(model.parameters())} "
          f"loss {final:.6f}", flush=True)
    job.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
