"""A worker of test_elastic_backend.py: the Fashion-MNIST MLP trained with
terse.elastic.ElasticBackendDDP (plain DDP over a terse backend group per generation) under
`terse run --elastic`, logging one line per applied step.

    terse run --elastic --max-restarts 1 -n 4 -- python elastic_backend_worker.py --steps 40 \\
        --kill-slot 2 --kill-step 10

Options: --kill-slot/--kill-step: that slot SIGKILLs itself after the step's forward, before
its backward (in its first incarnation only), so that the others' allreduce in DDP's reducer
fails (--kill-before forward: before the forward, whose DDP broadcasts the rebuilt buckets at
the second step of each generation); --stop-slot/--stop-step/--stop-seconds: that slot stops
itself (SIGSTOP) between forward and backward of the first step at or after --stop-step once it
has seen --stop-after re-formings, and a helper process wakes it (SIGCONT) after the given
seconds; --codec (terse.backend.configure).
Lines: "STARTED slot K pid P at T" first, "APPLIED step S pid P gen G size N at T digest D"
after each applied step, "EVENT {...}" per re-forming, "FINAL step S digest D loss L" at the
end.
"""

import time

STARTED = time.time()  # before the imports below, which take seconds

import argparse  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402

import torch  # noqa: E402

import terse.backend  # noqa: E402
import terse.elastic  # noqa: E402
from elastic_worker import finish, global_batch, stop_self  # noqa: E402
from fashion_mlp import digest, make_model  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--codec", default=None)
    ap.add_argument("--kill-slot", type=int, default=-1)
    ap.add_argument("--kill-step", type=int, default=-1)
    ap.add_argument("--kill-before", choices=["backward", "forward"], default="backward",
                    help="where in the step the killed slot dies")
    ap.add_argument("--stop-slot", type=int, default=-1)
    ap.add_argument("--stop-step", type=int, default=-1)
    ap.add_argument("--stop-after", type=int, default=0,
                    help="re-formings this worker must have seen before it stops")
    ap.add_argument("--stop-seconds", type=float, default=0)
    ap.add_argument("--settle", type=float, default=1.5)
    ap.add_argument("--step-seconds", type=float, default=0,
                    help="sleep this long in each step (compute a restarted worker overlaps)")
    args = ap.parse_args()

    torch.set_num_threads(1)
    slot = int(os.environ["RANK"])
    print(f"STARTED slot {slot} pid {os.getpid()} at {STARTED:.3f}", flush=True)
    first = int(os.environ.get("TERSE_RESTART_COUNT", "0")) == 0
    stopped = False
    if args.codec is not None:
        terse.backend.configure(codec=args.codec)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    job = terse.elastic.ElasticBackendDDP(
        model, opt, settle=args.settle,
        log=lambda text: print(f"LOG slot {slot}: {text}", flush=True))
    loss_fn = torch.nn.CrossEntropyLoss()
    while job.step < args.steps:
        x, y = job.split(*global_batch(job.step))
        kill = first and slot == args.kill_slot and job.step == args.kill_step
        if kill and args.kill_before == "forward":
            os.kill(os.getpid(), signal.SIGKILL)
        loss = loss_fn(job.model(x), y)
        time.sleep(args.step_seconds)
        if kill:
            os.kill(os.getpid(), signal.SIGKILL)
        if (first and not stopped and slot == args.stop_slot and job.step >= args.stop_step
                and len(job.events) >= args.stop_after):
            stopped = True
            print(f"STOPPING at step {job.step} at {time.time():.3f}", flush=True)
            stop_self(args.stop_seconds)
        job.backward(loss)
        step, gen, size = job.step, job.generation.number, job.size  # commit() may re-form
        if job.commit():
            print(f"APPLIED step {step} pid {os.getpid()} gen {gen} size {size} at "
                  f"{time.time():.3f} digest {digest(model.parameters())}", flush=True)
    finish(job, model, loss_fn)
    return 0


if __name__ == "__main__":
    sys.exit(main())
