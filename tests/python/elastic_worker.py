"""A worker of test_elastic.py: the Fashion-MNIST MLP trained with terse.elastic.ElasticDDP under
`terse run --elastic`, logging one line per applied step.

    terse run --elastic --max-restarts 1 -n 4 -- python elastic_worker.py --steps 40 \\
        --kill-slot 2 --kill-step 12

Options: --kill-slot/--kill-step: that slot SIGKILLs itself before the step's commit (in its
first incarnation only); --stop-slot/--stop-step/--stop-seconds: that slot stops itself
(SIGSTOP) and a helper process wakes it (SIGCONT) after the given seconds; --codec.
Lines: "STARTED slot K pid P at T" first, "APPLIED step S pid P gen G size N at T digest D"
after each applied step, "EVENT {...}" per
re-forming, "FINAL step S digest D loss L" at the end.
"""

import time

STARTED = time.time()  # before the imports below, which take seconds

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

import torch  # noqa: E402

import terse.elastic  # noqa: E402
from fashion_mlp import data, digest, make_model  # noqa: E402

GLOBAL_BATCH = 48  # divides evenly among 3 and 4 workers


def global_batch(step: int):
    x, y = data()
    start = (step * GLOBAL_BATCH) % (x.shape[0] - GLOBAL_BATCH)
    return x[start:start + GLOBAL_BATCH], y[start:start + GLOBAL_BATCH]


def stop_self(seconds: float) -> None:
    """Stops this process (SIGSTOP); a helper process wakes it (SIGCONT) after ``seconds``."""
    subprocess.Popen([sys.executable, "-c", f"import os,signal,time; time.sleep({seconds}); "
                      f"os.kill({os.getpid()}, signal.SIGCONT)"])
    os.kill(os.getpid(), signal.SIGSTOP)


def finish(job, model, loss_fn) -> None:
    """The end of a data-parallel worker's log (its re-formings, then "FINAL" with its step,
    digest and loss on a fixed batch), then closes the job."""
    for event in job.events:
        print("EVENT " + json.dumps(event), flush=True)
    x, y = global_batch(10_000)
    with torch.no_grad():
        final = float(loss_fn(model(x), y))
    print(f"FINAL step {job.step} digest {digest(model.parameters())} loss {final:.6f}",
          flush=True)
    job.close()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--codec", default="none")
    ap.add_argument("--kill-slot", type=int, default=-1)
    ap.add_argument("--kill-step", type=int, default=-1)
    ap.add_argument("--stop-slot", type=int, default=-1)
    ap.add_argument("--stop-step", type=int, default=-1)
    ap.add_argument("--stop-seconds", type=float, default=0)
    ap.add_argument("--settle", type=float, default=1.5)
    ap.add_argument("--step-seconds", type=float, default=0,
                    help="sleep this long in each step (compute a restarted worker overlaps)")
    args = ap.parse_args()

    torch.set_num_threads(1)
    slot = int(os.environ["RANK"])
    print(f"STARTED slot {slot} pid {os.getpid()} at {STARTED:.3f}", flush=True)
    first = int(os.environ.get("TERSE_RESTART_COUNT", "0")) == 0
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    job = terse.elastic.ElasticDDP(
        model, opt, codec=args.codec, min_bytes=0, settle=args.settle,
        log=lambda text: print(f"LOG slot {slot}: {text}", flush=True))
    loss_fn = torch.nn.CrossEntropyLoss()
    loss = torch.zeros(())
    while job.step < args.steps:
        x, y = job.split(*global_batch(job.step))
        loss = loss_fn(job.model(x), y)
        loss.backward()
        time.sleep(args.step_seconds)
        if first and slot == args.kill_slot and job.step == args.kill_step:
            os.kill(os.getpid(), signal.SIGKILL)
        if first and slot == args.stop_slot and job.step == args.stop_step:
            first = False
            stop_self(args.stop_seconds)
        step, gen, size = job.step, job.generation.number, job.size  # commit() may re-form
        if job.commit():
            print(f"APPLIED step {step} pid {os.getpid()} gen {gen} size {size} at "
                  f"{time.time():.3f} digest {digest(model.parameters())}", flush=True)
    finish(job, model, loss_fn)
    return 0


if __name__ == "__main__":
    sys.exit(main())
