"""terse.Checkpointer: periodic per-rank checkpoints and automatic resume.

One process: what a save writes and how (atomically, a file per rank, pruned to `keep`), what
resume refuses (damaged files, another rank's, another world size, another codec or set of
objects) and which checkpoint it takes (the newest complete one). Then the end-to-end run: 4
ranks under torchrun --max_restarts 3 train DDP with the terse hook (checkpoint_worker.py),
one rank is killed while writing a checkpoint and another one step later in the next attempt;
the logs show that each restart resumed from the newest complete checkpoint and lost only the
steps since it, and the final parameters equal those of an uninterrupted run bit for bit.
"""

import os
import pathlib
import random
import signal
import subprocess
import textwrap
from typing import Dict, List

import numpy
import pytest
import torch

import terse
import terse.torch
from terse.checkpoint import MAGIC, read_header

from conftest import HERE, PYTHON

WORKER = HERE / "checkpoint_worker.py"


class FrontEnd:
    """A terse front end in miniature: a policy (whose settings a checkpoint records) and
    per-rank state."""

    def __init__(self, codec: str = "fp16") -> None:
        self.policy = terse.Policy(codec)
        self.residual = torch.zeros(4)

    def state_dict(self):
        return {"residual": self.residual.clone()}

    def load_state_dict(self, state) -> None:
        self.residual.copy_(state["residual"])


def make(directory, rank: int = 0, world: int = 1, codec: str = "fp16", seed: int = 0, **knobs):
    """A Checkpointer (this rank of `world`, given by hand) over a small model, its SGD and a
    front end; returns it with the three."""
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    front = FrontEnd(codec)
    knobs.setdefault("every", 2)
    checkpoint = terse.Checkpointer(directory, model=model, optimizer=optimizer,
                                    terse_state=front, rank=rank, world_size=world, **knobs)
    return checkpoint, model, optimizer, front


def train_step(model, optimizer) -> None:
    optimizer.zero_grad()
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()


def rank_file(directory, step: int, rank: int) -> pathlib.Path:
    return pathlib.Path(directory) / f"step-{step:010d}" / f"rank-{rank:05d}.ckpt"


def folders(directory) -> List[str]:
    return sorted(p.name for p in pathlib.Path(directory).iterdir())


# ---- one process ---------------------------------------------------------------------------

def test_resume_restores_the_objects_the_data_position_and_the_random_streams(tmp_path):
    checkpoint, model, optimizer, front = make(tmp_path)
    train_step(model, optimizer)
    front.residual += 0.5
    assert checkpoint.step(2, data={"epoch": 1, "position": 3})
    saved = [p.detach().clone() for p in model.parameters()]
    momentum = [optimizer.state[p]["momentum_buffer"].clone() for p in model.parameters()]
    draws = (torch.rand(3), random.random(), numpy.random.rand())

    again, model2, optimizer2, front2 = make(tmp_path, seed=1)
    train_step(model2, optimizer2)  # other parameters and momentum, moved random streams
    assert not torch.equal(model2.weight, saved[0])
    step, data = again.resume()
    assert (step, data) == (2, {"epoch": 1, "position": 3})
    assert again.resumed_from == 2
    for p, s, m in zip(model2.parameters(), saved, momentum):
        assert torch.equal(p, s)
        assert torch.equal(optimizer2.state[p]["momentum_buffer"], m)
    assert torch.equal(front2.residual, torch.full((4,), 0.5))
    # The resumed run draws the numbers the saving run drew next.
    assert torch.equal(torch.rand(3), draws[0])
    assert random.random() == draws[1]
    assert numpy.random.rand() == draws[2]


def test_a_fresh_directory_starts_at_zero(tmp_path):
    checkpoint, *_ = make(tmp_path / "none-yet")
    assert checkpoint.resume() == (0, {})
    assert checkpoint.resumed_from is None


def test_step_saves_every_n_steps_once(tmp_path):
    checkpoint, *_ = make(tmp_path, every=3)
    assert [checkpoint.step(s) for s in (1, 2, 3, 3, 4, 6)] == [False, False, True, False,
                                                                 False, True]
    assert checkpoint.complete_steps() == [6, 3]


def test_a_file_is_written_whole_or_not_at_all(tmp_path):
    checkpoint, *_ = make(tmp_path)
    path = checkpoint.save(2)
    assert path == str(rank_file(tmp_path, 2, 0))
    assert os.listdir(os.path.dirname(path)) == ["rank-00000.ckpt"]  # no temporary left
    header = read_header(path)
    assert (header["rank"], header["world_size"], header["step"]) == (0, 1, 2)
    assert header["terse"]["terse_state"]["codec"] == "fp16"
    assert header["objects"] == ["model", "optimizer", "terse_state"]
    assert header["offset"] + header["payload_bytes"] == os.path.getsize(path)

    class Unpicklable:
        def __reduce__(self):
            raise RuntimeError("cannot pickle this")

    with pytest.raises(RuntimeError, match="cannot pickle this"):
        checkpoint.save(4, data={"bad": Unpicklable()})
    assert os.listdir(tmp_path / "step-0000000004") == []  # the temporary was removed
    assert checkpoint.complete_steps() == [2]


def test_a_rank_killed_while_writing_leaves_no_file(tmp_path):
    # A process that SIGKILLs itself in the middle of torch.save of its checkpoint of step 4.
    script = textwrap.dedent(f"""
        import os, signal, sys
        sys.path.insert(0, {str(HERE)!r})
        from test_checkpoint import make
        class Bomb:
            def __reduce__(self):
                os.kill(os.getpid(), signal.SIGKILL)
        checkpoint, model, optimizer, front = make({str(tmp_path)!r})
        checkpoint.save(2)
        checkpoint.save(4, data={{"big": [1.0] * 100000, "bomb": Bomb()}})
    """)
    proc = subprocess.run([PYTHON, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    names = os.listdir(tmp_path / "step-0000000004")
    assert len(names) == 1 and names[0].startswith(".rank-00000.ckpt.tmp-"), names
    checkpoint, *_ = make(tmp_path)
    assert checkpoint.complete_steps() == [2]
    assert checkpoint.resume().step == 2
    assert folders(tmp_path) == ["step-0000000002"]  # the remains were deleted


@pytest.mark.parametrize("damage", ["flipped", "truncated", "garbage", "header"])
def test_a_damaged_file_is_refused(tmp_path, damage):
    checkpoint, *_ = make(tmp_path)
    path = pathlib.Path(checkpoint.save(2))
    data = bytearray(path.read_bytes())
    if damage == "flipped":
        data[-100] ^= 0x01
    elif damage == "truncated":
        del data[len(data) // 2:]
    elif damage == "garbage":
        data = bytearray(b"PK\x03\x04 not ours" + bytes(100))
    else:
        at = len(MAGIC) + 4
        data[at:at + 1] = b"#"
    path.write_bytes(bytes(data))
    again, *_ = make(tmp_path)
    expected = {"flipped": "sha256", "truncated": "truncated", "garbage": "not a terse checkpoint",
                "header": "header is not JSON"}[damage]
    with pytest.raises(terse.DecodeError, match=expected) as error:
        again.resume()
    assert str(path) in str(error.value)


def test_another_ranks_file_is_refused(tmp_path):
    for rank in (0, 1):
        make(tmp_path, rank=rank, world=2)[0].save(2)
    rank_file(tmp_path, 2, 0).write_bytes(rank_file(tmp_path, 2, 1).read_bytes())
    checkpoint, *_ = make(tmp_path, rank=0, world=2)
    with pytest.raises(terse.MismatchError, match="holds the state of rank 1, and this is rank 0"):
        checkpoint.resume()


def test_another_world_size_is_refused(tmp_path):
    # Saved by 2 ranks, resumed by 1: the folder looks complete, the file says 2 ranks.
    for rank in (0, 1):
        make(tmp_path / "two", rank=rank, world=2)[0].save(2)
    with pytest.raises(terse.MismatchError,
                       match="a job of world size 2, and this one has world size 1") as error:
        make(tmp_path / "two")[0].resume()
    assert str(rank_file(tmp_path / "two", 2, 0)) in str(error.value)
    # Saved by 1 rank, resumed by 2: incomplete for 2 ranks, but not deleted as remains.
    make(tmp_path / "one")[0].save(2)
    with pytest.raises(terse.MismatchError,
                       match="a job of world size 1, and this one has world size 2"):
        make(tmp_path / "one", rank=0, world=2)[0].resume()
    assert rank_file(tmp_path / "one", 2, 0).exists()


def test_another_codec_is_refused(tmp_path):
    make(tmp_path, codec="fp16")[0].save(2)
    checkpoint, *_ = make(tmp_path, codec="onebit:ef=1")
    with pytest.raises(terse.MismatchError,
                       match="saved with terse_state codec='fp16', and this run has "
                             "codec='onebit:ef=1'") as error:
        checkpoint.resume()
    assert str(rank_file(tmp_path, 2, 0)) in str(error.value)


def test_the_hook_states_settings_are_checked(tmp_path):
    """The same with the DDP hook's real state (one rank, its own communicator)."""

    def hook_checkpointer(codec):
        comm = terse.Communicator(0, 1, terse.file_store(str(tmp_path / f"store-{codec}")))
        model = torch.nn.Linear(64, 64)
        state = terse.torch.TerseHookState(model, codec=codec, min_bytes=0, communicator=comm)
        return terse.Checkpointer(tmp_path / "ckpt", every=1, model=model,
                                  terse_state=state), state

    checkpoint, state = hook_checkpointer("powersgd:rank=2")
    checkpoint.save(1)
    header = read_header(str(rank_file(tmp_path / "ckpt", 1, 0)))
    assert header["terse"]["terse_state"]["front end"] == "terse.torch.TerseHookState"
    assert header["terse"]["terse_state"]["codec"] == "powersgd:rank=2"
    state.close()
    checkpoint, state = hook_checkpointer("fp16")
    with pytest.raises(terse.MismatchError, match="codec='powersgd:rank=2'.*codec='fp16'"):
        checkpoint.resume()
    state.close()


@pytest.mark.parametrize("front", ["optim", "diloco"])
def test_the_other_doors_resume_bit_for_bit(tmp_path, front):
    """A terse optimizer (as optimizer=) and DiLoCo (as terse_state=), on one rank: 3 steps,
    a checkpoint, 4 more; resumed in fresh objects, the same 4 steps end with the same bits."""
    import terse.diloco
    import terse.optim

    def build(run):
        comm = terse.Communicator(0, 1, terse.file_store(str(tmp_path / f"store-{run}")))
        torch.manual_seed(0)
        # No dropout: 1-bit Adam's elements of zero variance at the freeze (units dropped in
        # every warm-up step) would move by m / eps and overflow.
        model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(),
                                    torch.nn.Linear(32, 2))
        if front == "optim":
            optimizer = terse.optim.OneBitAdam(model.parameters(), lr=1e-2, freeze_step=2,
                                               eps=1e-4, communicator=comm, threads=1)
            objects = dict(model=model, optimizer=optimizer)
        else:
            inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
            optimizer = terse.diloco.DiLoCo(model, inner, sync_every=2,
                                            codec="minmax8:bits=4,ef=1", communicator=comm,
                                            threads=1)
            objects = dict(model=model, terse_state=optimizer)
        return model, optimizer, terse.Checkpointer(tmp_path / "ckpt", every=3, **objects)

    def train(model, optimizer, steps):
        for step in steps:
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
            optimizer.zero_grad()
            model(x).square().mean().backward()
            optimizer.step()
        return [p.detach().clone() for p in model.parameters()]

    model, optimizer, checkpoint = build(0)
    assert checkpoint.resume().step == 0
    train(model, optimizer, range(3))
    assert checkpoint.step(3)
    expected = train(model, optimizer, range(3, 7))
    optimizer.close()
    header = read_header(str(rank_file(tmp_path / "ckpt", 3, 0)))
    role = "optimizer" if front == "optim" else "terse_state"
    assert header["terse"][role]["front end"] == type(optimizer).__module__ + "." + \
        type(optimizer).__qualname__

    model, optimizer, checkpoint = build(1)
    assert checkpoint.resume().step == 3
    resumed = train(model, optimizer, range(3, 7))
    optimizer.close()
    assert all(torch.isfinite(a).all() for a in expected)
    assert all(torch.equal(a, b) for a, b in zip(resumed, expected))


def test_other_objects_are_refused(tmp_path):
    make(tmp_path)[0].save(2)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    scheduler = torch.optim.lr_scheduler.StepLR(torch.optim.SGD(model.parameters(), lr=1), 1)
    checkpoint = terse.Checkpointer(tmp_path, every=2, model=model,
                                    extra={"scheduler": scheduler})
    with pytest.raises(terse.MismatchError, match="holds the state of model, optimizer, "
                                                  "terse_state, and this Checkpointer saves "
                                                  "extra.scheduler, model"):
        checkpoint.resume()


def test_keep_deletes_older_checkpoints(tmp_path):
    checkpoint, *_ = make(tmp_path, every=1, keep=2)
    for step in range(1, 6):
        checkpoint.step(step)
    assert checkpoint.complete_steps() == [5, 4]
    assert folders(tmp_path) == ["step-0000000004", "step-0000000005"]


def test_keep_counts_complete_checkpoints_only(tmp_path):
    ranks = [make(tmp_path, rank=r, world=2, keep=2)[0] for r in (0, 1)]
    for step in (2, 4):
        for c in ranks:
            c.save(step)
    ranks[0].save(6)  # rank 1 has not written 6 yet: 4 and 2 are the complete ones, kept
    assert ranks[0].complete_steps() == [4, 2]
    assert len(folders(tmp_path)) == 3
    ranks[1].save(6)
    ranks[0].save(8)  # 6 and 4 kept, 8 being written, 2 deleted
    assert folders(tmp_path) == ["step-0000000004", "step-0000000006", "step-0000000008"]


def test_an_incomplete_newest_checkpoint_is_skipped(tmp_path):
    (c0, m0, o0, _), (c1, m1, o1, _) = [make(tmp_path, rank=r, world=2, seed=r) for r in (0, 1)]
    c0.save(2, data={"position": 2})
    c1.save(2, data={"position": 2})
    at_two = [[p.detach().clone() for p in m.parameters()] for m in (m0, m1)]
    train_step(m0, o0)
    c0.save(4, data={"position": 4})  # rank 1 died before writing 4; its temporary remains:
    (tmp_path / "step-0000000004" / ".rank-00001.ckpt.tmp-12345").write_bytes(b"partial")
    for rank in (1, 0):  # rank 0 last: it deletes the incomplete checkpoint
        checkpoint, model, *_ = make(tmp_path, rank=rank, world=2, seed=7)
        assert checkpoint.resume() == (2, {"position": 2})
        assert all(torch.equal(p, s) for p, s in zip(model.parameters(), at_two[rank]))
    assert folders(tmp_path) == ["step-0000000002"]


def test_the_arguments_are_checked(tmp_path):
    for knobs, message in ((dict(every=0), "every must be"), (dict(every=2, keep=0), "keep must"),
                           (dict(every=2, rank=0), "rank and world_size together"),
                           (dict(every=2, rank=2, world_size=2), "not in 0..1"),
                           (dict(every=2, model=object()), "has no state_dict")):
        with pytest.raises(terse.InvalidArgument, match=message):
            terse.Checkpointer(tmp_path, **knobs)


# ---- torchrun, with restarts ---------------------------------------------------------------

RANKS = 4
STEPS = 24
EVERY = 4
# Attempt 0: rank 2 dies while writing the checkpoint after 12 steps (the others have written
# theirs, so 12 is incomplete and 8 the newest complete one). Attempt 1: rank 1 dies before the
# backward of step 17 (16 is complete). Attempt 2 finishes.
KILLS = ["0:2:12:write", "1:1:17"]


def torchrun(out: pathlib.Path, kills: List[str]) -> Dict[int, List[List[str]]]:
    """Runs checkpoint_worker.py on RANKS ranks under torchrun with 3 restarts; returns each
    rank's log lines, split."""
    out.mkdir(parents=True)
    cmd = [PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(RANKS),
           "--max_restarts", "3", "--monitor_interval", "0.5",
           # torch 1.13 on Python 3.11 fails on its default (no redirection) and on 3 (both
           # streams): redirect and tee stdout only.
           "--redirects", "1", "--tee", "1", "--log_dir", str(out / "torchrun"),
           str(WORKER), "--out", str(out), "--checkpoints", str(out / "checkpoints"),
           "--steps", str(STEPS), "--every", str(EVERY), *[f"--kill={k}" for k in kills]]
    # torch >= 2.4 shares the rendezvous' TCPStore with the workers and keeps it across
    # restarts: the restarted ranks' Gloo then reads the dead ranks' addresses and never
    # connects (docs/python.md, "Automatic resume"). A store per attempt avoids it.
    env = dict(os.environ, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", TERSE_TIMEOUT="20")
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=240, env=env)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout}"
    return {r: [line.split() for line in (out / f"log-rank-{r}.txt").read_text().splitlines()]
            for r in range(RANKS)}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    return torchrun(tmp_path_factory.mktemp("resume") / "uninterrupted", [])


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    return torchrun(tmp_path_factory.mktemp("resume") / "killed", KILLS)


def attempts(lines: List[List[str]]) -> Dict[int, Dict[str, object]]:
    """Per attempt: where it resumed, the steps it finished (index -> loss, epoch, batch), the
    checkpoints this rank wrote and its final digest."""
    out: Dict[int, Dict[str, object]] = {}
    for kind, attempt, *rest in lines:
        a = out.setdefault(int(attempt), {"steps": {}, "saved": set(), "done": None})
        if kind == "resume":
            a["resume"] = int(rest[0])
        elif kind == "step":
            a["steps"][int(rest[0])] = tuple(rest[1:])
        elif kind == "saved":
            a["saved"].add(int(rest[0]))
        else:
            a["done"] = rest[0]
    return out


def test_each_restart_resumes_from_the_newest_complete_checkpoint(killed):
    logs = [attempts(killed[r]) for r in range(RANKS)]
    assert all(sorted(log) == [0, 1, 2] for log in logs)  # two restarts, three attempts
    for attempt in (0, 1):
        # The checkpoints every rank wrote in this attempt: 12 in attempt 0 is not among them.
        complete = set.intersection(*(log[attempt]["saved"] for log in logs))
        newest = max(complete)
        assert newest == {0: 8, 1: 16}[attempt]
        assert all(log[attempt + 1]["resume"] == newest for log in logs)


def test_only_the_steps_since_that_checkpoint_are_lost(killed):
    for r in range(RANKS):
        log = attempts(killed[r])
        assert log[0]["resume"] == 0
        for attempt in (1, 2):
            before, start = log[attempt - 1]["steps"], log[attempt]["resume"]
            lost = sorted(s for s in before if s >= start)
            # Steps done before the kill and done again: exactly those after the checkpoint.
            assert lost == list(range(start, max(before) + 1)), (r, attempt, lost)
        assert sorted(log[0]["steps"]) == list(range(12))
        assert sorted(log[1]["steps"]) == list(range(8, 17))
        assert sorted(log[2]["steps"]) == list(range(16, STEPS))


def test_resumed_steps_repeat_the_uninterrupted_run(killed, uninterrupted):
    """Every step of every attempt computed the loss of the uninterrupted run's step, on the
    same batch (the data position) with the same dropout (the random streams)."""
    for r in range(RANKS):
        reference = attempts(uninterrupted[r])[0]["steps"]
        assert sorted(reference) == list(range(STEPS))
        for attempt, log in attempts(killed[r]).items():
            for step, (loss, epoch, batch) in log["steps"].items():
                assert (loss, epoch, batch) == reference[step], (r, attempt, step)


def test_the_final_parameters_equal_an_uninterrupted_run_bit_for_bit(killed, uninterrupted):
    reference = {attempts(uninterrupted[r])[0]["done"] for r in range(RANKS)}
    assert len(reference) == 1 and None not in reference
    final = {attempts(killed[r])[2]["done"] for r in range(RANKS)}
    assert final == reference
