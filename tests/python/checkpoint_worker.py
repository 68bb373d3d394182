"""One rank of the automatic-resume test (tests/python/test_checkpoint.py), started by torchrun.

Trains a small MLP (with dropout, so that the random streams matter) under DDP with the terse
hook (onebit:ef=1: error feedback on both sides of the exchange, different on every rank) on
synthetic data read through a DistributedSampler, checkpointing every EVERY steps with
terse.Checkpointer and resuming from it when torchrun restarts the group. Each rank appends to
OUT/log-rank-R.txt one line per event, flushed at once (a killed rank leaves what it finished):

    resume ATTEMPT STEP EPOCH POSITION    where this attempt starts
    step ATTEMPT INDEX LOSS EPOCH BATCH   step INDEX (0-based) done, its loss as float.hex
    saved ATTEMPT STEPS                   a checkpoint after STEPS steps written by this rank
    done ATTEMPT DIGEST                   training finished; the parameters' sha256

--kill ATTEMPT:RANK:STEP[:write] (repeatable): in attempt ATTEMPT (torchrun's
TORCHELASTIC_RESTART_COUNT), rank RANK SIGKILLs itself before the backward of step STEP, or with
":write" while writing the checkpoint after STEP steps (in the middle of pickling its data
position: its file is left as a partial temporary).
"""

import argparse
import hashlib
import itertools
import os
import signal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import terse
import terse.torch

SAMPLES = 256
BATCH = 8
FEATURES = 32


class _KillWhilePickled:
    """Put in the data position of the victim's checkpoint: pickling it (halfway through
    torch.save of the payload) kills the process."""

    def __reduce__(self):
        os.kill(os.getpid(), signal.SIGKILL)
        return (int, ())  # not reached


def make_model() -> torch.nn.Module:
    torch.manual_seed(1234)
    return torch.nn.Sequential(
        torch.nn.Linear(FEATURES, 64), torch.nn.ReLU(), torch.nn.Dropout(0.2),
        torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(99)
    x = torch.randn(SAMPLES, FEATURES, generator=g)
    y = (x[:, :10].argmax(dim=1) + (torch.rand(SAMPLES, generator=g) < 0.2).long()) % 10
    return TensorDataset(x, y)


def digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().numpy().tobytes())
    return h.hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--checkpoints", required=True)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--every", type=int, default=4)
    parser.add_argument("--codec", default="onebit:ef=1")
    parser.add_argument("--kill", action="append", default=[])
    args = parser.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    kills = {}
    for spec in args.kill:
        a, r, s, *how = spec.split(":")
        if int(a) == attempt and int(r) == rank:
            kills[int(s)] = how[0] if how else "step"

    log = open(os.path.join(args.out, f"log-rank-{rank}.txt"), "a", buffering=1)

    def record(line: str) -> None:
        log.write(line + "\n")
        log.flush()
        os.fsync(log.fileno())

    model = DDP(make_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    state, hook = terse.torch.ddp_hook(model, codec=args.codec, min_bytes=4 << 10, threads=1)
    model.register_comm_hook(state, hook)
    sampler = DistributedSampler(dataset(), shuffle=True, seed=7, drop_last=True)
    loader = DataLoader(dataset(), batch_size=BATCH, sampler=sampler)

    # The lines a user adds: a Checkpointer, resume, and step() after each training step.
    checkpoint = terse.Checkpointer(args.checkpoints, every=args.every, keep=2, model=model,
                                    optimizer=optimizer, terse_state=state)
    step, data = checkpoint.resume()
    epoch, position = data.get("epoch", 0), data.get("position", 0)
    record(f"resume {attempt} {step} {epoch} {position}")
    while step < args.steps:
        sampler.set_epoch(epoch)
        for i, (x, y) in enumerate(itertools.islice(loader, position, None), start=position):
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            if kills.get(step) == "step":
                os.kill(os.getpid(), signal.SIGKILL)
            loss.backward()
            optimizer.step()
            record(f"step {attempt} {step} {loss.item().hex()} {epoch} {i}")
            step += 1
            # Where the next batch comes from: a finished epoch resumes at the next one's
            # start (starting an iterator of the finished epoch would draw from torch's random
            # stream, which the DataLoader seeds its iterators from).
            data = ({"epoch": epoch, "position": i + 1} if i + 1 < len(loader)
                    else {"epoch": epoch + 1, "position": 0})
            if kills.get(step) == "write":
                data["kill"] = _KillWhilePickled()
            if checkpoint.step(step, data=data):
                record(f"saved {attempt} {step}")
            if step == args.steps:
                break
        epoch, position = epoch + 1, 0
    record(f"done {attempt} {digest(model.module)}")
    state.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
