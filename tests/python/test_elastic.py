"""terse.elastic's live recovery, with real processes under `terse run --elastic`: one worker of
four killed (SIGKILL) and started again, one stopped (SIGSTOP) past the timeout and woken; the
survivors are never restarted, every step is applied once, replicas hash alike after every step
and the final loss equals the fault-free run's (elastic_worker.py)."""

import collections
import re

from conftest import HERE, elastic_applied, elastic_events, elastic_pids, run_elastic

WORKER = HERE / "elastic_worker.py"
STEPS = 80  # a restarted or woken worker has ~10 s to be back before the end
TIMEOUT = 5  # seconds: how long a stalled worker holds the others up


def _run(*args, restarts=1):
    return run_elastic(WORKER, ["--steps", STEPS, "--step-seconds", 0.15, *args],
                       timeout=TIMEOUT, restarts=restarts)






def _finals(out):
    return {int(m.group(1)): (int(m.group(2)), m.group(3), float(m.group(4)))
            for m in re.finditer(r"\[rank (\d+)\] FINAL step (\d+) digest (\w+) loss ([\d.]+)",
                                 out)}


def _check_steps(out):
    """Every step applied exactly once by each process that applied it, by every member of the
    generation alike (one digest per step and generation), and by four workers at the end."""
    steps = elastic_applied(out)
    assert sorted(steps) == list(range(STEPS)), out
    for step, rows in steps.items():
        pids = [r[1] for r in rows]
        assert len(pids) == len(set(pids)), f"step {step} applied twice by one process\n{out}"
        by_gen = collections.defaultdict(set)
        for _, _, gen, size, _, digest in rows:
            by_gen[(gen, size)].add(digest)
        for (gen, size), digests in by_gen.items():
            assert len(digests) == 1, f"step {step}, generation {gen}: replicas differ\n{out}"
            assert sum(1 for r in rows if r[2] == gen) == size, out
    finals = _finals(out)
    assert sorted(finals) == [0, 1, 2, 3], out
    assert len({f[1] for f in finals.values()}) == 1, out
    assert all(f[0] == STEPS for f in finals.values()), out
    return steps, finals




def _gap(steps, step):
    """Seconds from the last commit of step - 1 to the first of step: the fault's cost."""
    return min(r[4] for r in steps[step]) - max(r[4] for r in steps[step - 1])




def test_a_killed_worker_is_replaced_while_the_others_go_on():
    clean = _run()
    _, clean_finals = _check_steps(clean)
    out = _run("--kill-slot", 2, "--kill-step", 10)
    steps, finals = _check_steps(out)
    # Survivors never restarted; slot 2 started twice.
    assert [len(elastic_pids(out, s)) for s in range(4)] == [1, 1, 2, 1], out
    assert out.count("starting it again") == 1, out
    # The survivors went on in 3 within 5 s of the kill, then took the new worker back in.
    events = elastic_events(out, 0)
    whys = [e["why"] for e in events]
    assert whys == ["start", "failure", "join"], out
    assert events[1]["slots"] == [0, 1, 3] and events[2]["slots"] == [0, 1, 2, 3], out
    assert _gap(steps, 10) < 5, out
    # The new worker's first step back hashes like everyone's.
    replacement = elastic_pids(out, 2)[1]
    back = min(s for s, rows in steps.items() if any(r[1] == replacement for r in rows))
    assert len({r[5] for r in steps[back]}) == 1, out
    # The same global batches at every step: the loss of the fault-free run, to 1%.
    loss, clean_loss = finals[0][2], clean_finals[0][2]
    assert abs(loss - clean_loss) <= 0.01 * clean_loss, (loss, clean_loss)


def test_a_stalled_worker_is_left_out_then_taken_back_with_the_state():
    out = _run("--stop-slot", 1, "--stop-step", 12, "--stop-seconds", TIMEOUT + 4)
    steps, _ = _check_steps(out)
    assert [len(elastic_pids(out, s)) for s in range(4)] == [1, 1, 1, 1], out
    assert "starting it again" not in out, out
    events = elastic_events(out, 0)
    assert [e["why"] for e in events] == ["start", "failure", "join"], out
    assert events[1]["slots"] == [0, 2, 3], out
    # Back to training within the timeout (the stall's detection) + 5 s.
    assert _gap(steps, 12) < TIMEOUT + 5, out
    stalled = elastic_events(out, 1)
    assert stalled[-1]["state_bytes"] > 0 and stalled[-1]["slots"] == [0, 1, 2, 3], out
