"""The churn drill for terse.elastic: the same training run fault-free and under faults, in one
invocation, several times; reports goodput, loss and accuracy against the fault-free run, lost
or repeated steps, and recovery times.

    /opt/terse/venv/bin/python bench/elastic_drill.py --repeats 3 --seconds 240 \\
        --kill-every 60 --link 1gbit --out results/elastic

Each run: 4 workers under `terse run --elastic --max-restarts 100` (with --link: each on an
emulated host of its own, scripts/cluster.sh -e, links shaped to that rate), a Fashion-MNIST
MLP with SGD with momentum and a cosine learning rate, the terse hook (codec --codec), a fixed
global batch per step split among the members. The faulty run kills (SIGKILL) one worker every
--kill-every seconds, in turn, and stops one (SIGSTOP) for --timeout + 3 s once, midway; the
launcher restarts each killed worker. Measured: goodput (the fault-free run's seconds for the
same steps over the faulty run's), the final test loss and accuracy of both, steps applied
twice or never (from every worker's per-step log), each kill's cost (last commit before it to
the next commit after it), and each replacement's time from its process's start to its first
step in lock step (with its state's bytes), split into importing python and torch, loading data
and model, and joining. Each drill also runs the compute-only floor (the same steps, each
worker its share of every batch, no communication). Prints a table of medians and writes
drill.json under --out. `--peer torchft` runs the same drill through torchft (PyPI) instead:
its Manager, Lighthouse (in this process) and OptimizerWrapper, one replica group per worker,
healing from a live replica (on loopback only).
"""

import argparse
import collections
import json
import math
import os
import pathlib
import re
import signal
import statistics
import subprocess
import sys
import threading
import time

HERE = pathlib.Path(__file__).resolve().parent
REPO = HERE.parent


def _process_start() -> float:
    """When this process was started (forked by the launcher), on the wall clock."""
    with open("/proc/self/stat") as f:
        started = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22: starttime, in ticks
    since = time.clock_gettime(time.CLOCK_BOOTTIME) - started / os.sysconf("SC_CLK_TCK")
    return time.time() - since


class _Training:
    """What every drill worker trains, whoever carries its gradients: the Fashion-MNIST MLP,
    SGD with momentum and a cosine learning rate, one global batch per step."""

    def __init__(self, args) -> None:
        import torch

        from terse.demo import load_fashion_mnist

        imported = time.time()
        torch.set_num_threads(1)
        self.slot = int(os.environ["RANK"])
        print(f"STARTED slot {self.slot} pid {os.getpid()} at {_process_start():.3f} imported "
              f"{imported:.3f}", flush=True)
        self.args = args
        self.x, self.y = (torch.from_numpy(a) for a in load_fashion_mnist("train"))
        self.x_test, self.y_test = (torch.from_numpy(a) for a in load_fashion_mnist("test"))
        torch.manual_seed(1234)
        self.model = torch.nn.Sequential(torch.nn.Linear(784, 256), torch.nn.ReLU(),
                                         torch.nn.Linear(256, 128), torch.nn.ReLU(),
                                         torch.nn.Linear(128, 10))
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.05, momentum=0.9)
        self.loss_fn = torch.nn.CrossEntropyLoss()
        self.samples = self.x.shape[0] - self.x.shape[0] % args.batch
        print(f"READY pid {os.getpid()} at {time.time():.3f}", flush=True)

    def batch(self, step: int):
        """Step ``step``'s global batch; its learning rate set (cosine decay)."""
        for group in self.opt.param_groups:
            group["lr"] = 0.05 * 0.5 * (1 + math.cos(math.pi * step / self.args.steps))
        start = (step * self.args.batch) % self.samples
        return self.x[start:start + self.args.batch], self.y[start:start + self.args.batch]

    def applied(self, step: int) -> None:
        print(f"APPLIED {step} {os.getpid()} {time.time():.3f}", flush=True)

    def final(self, steps: int) -> None:
        import torch

        with torch.no_grad():
            logits = self.model(self.x_test)
            loss = float(self.loss_fn(logits, self.y_test))
            accuracy = float((logits.argmax(1) == self.y_test).float().mean())
        print(f"FINAL {steps} {loss:.6f} {accuracy:.6f}", flush=True)


def worker(args) -> int:
    import terse.elastic

    t = _Training(args)
    job = terse.elastic.ElasticDDP(t.model, t.opt, codec=args.codec,
                                   log=lambda text: print(f"LOG {text}", flush=True))
    while job.step < args.steps:
        x, y = job.split(*t.batch(job.step))
        t.loss_fn(job.model(x), y).backward()
        step = job.step
        if job.commit():
            t.applied(step)
    for event in job.events:
        print("EVENT " + json.dumps(event), flush=True)
    t.final(job.step)
    job.close()
    return 0


def floor_worker(args) -> int:
    """The compute-only floor: each worker its share of the same steps, no communication."""
    import torch

    t = _Training(args)
    for step in range(args.steps):
        x, y = (torch.tensor_split(v, args.workers)[t.slot] for v in t.batch(step))
        t.loss_fn(t.model(x), y).backward()
        t.opt.step()
        t.opt.zero_grad()
        t.applied(step)
    t.final(args.steps)
    return 0


def torchft_worker(args) -> int:
    """The same training through torchft (PyPI): the Manager's allreduce of each gradient and
    its OptimizerWrapper, one replica group per worker, the Lighthouse in the drill's process; a
    restarted worker heals from a live replica through torchft's checkpoint transport."""
    os.environ.setdefault("RUST_LOG", "warn")
    from datetime import timedelta

    import torch.distributed as dist
    from torchft import Manager, ProcessGroupGloo
    from torchft.optim import OptimizerWrapper

    t = _Training(args)
    model, inner = t.model, t.opt
    wait = timedelta(seconds=args.timeout)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=wait)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=wait),
        load_state_dict=lambda st: (model.load_state_dict(st["model"]),
                                    inner.load_state_dict(st["optim"])),
        state_dict=lambda: {"model": model.state_dict(), "optim": inner.state_dict()},
        min_replica_size=1, use_async_quorum=False, timeout=wait, quorum_timeout=wait * 4,
        connect_timeout=wait, rank=0, world_size=1, store_addr="127.0.0.1",
        store_port=store.port, lighthouse_addr=os.environ["TORCHFT_LIGHTHOUSE"],
        replica_id=f"drill_{t.slot}", hostname="127.0.0.1")
    # Gradients through the Manager's allreduce, which turns a peer's failure into a skipped
    # commit. (torchft's DDP wrapper was tried first: its comm hook fails on that error path,
    # "AttributeError: 'Future' object has no attribute '_fut'", and every survivor exited.)
    opt = OptimizerWrapper(manager, inner)
    while manager.current_step() < args.steps:
        opt.zero_grad()  # the quorum: who takes part in this step, and healing
        step = manager.current_step()
        parts = max(1, manager.num_participants())
        share = manager.participating_rank() or 0
        x, y = (v.tensor_split(parts)[share] for v in t.batch(step))
        t.loss_fn(model(x), y).backward()
        works = [manager.allreduce(p.grad) for p in model.parameters()]
        for work in works:
            work.wait()
        opt.step()  # applies the step where every participant committed
        if manager.current_step() > step:
            t.applied(step)
    t.final(manager.current_step())
    sys.stdout.flush()
    os._exit(0)  # torchft's native threads may abort a normal teardown


def run_once(args, faults: bool) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(REPO / "build" / "python"), str(HERE),
                                           os.environ.get("PYTHONPATH", "")]))
    worker_cmd = [sys.executable, __file__, "--worker", "--peer", args.peer, "--steps",
                  str(args.steps), "--batch", str(args.batch), "--codec", args.codec,
                  "--timeout", str(args.timeout)]
    if args.link:  # emulated hosts; the launcher runs in host 0's namespace
        env.update(TERSE=args.terse, TERSE_TIMEOUT=str(args.timeout))
        cmd = ["bash", str(REPO / "scripts" / "cluster.sh"), "-n",
               str(args.workers // args.ranks_per_host), "-l", str(args.ranks_per_host), "-r",
               args.link, "-e", "100", "--"] + worker_cmd
    else:
        cmd = [args.terse, "run", "--elastic", "--max-restarts", "100", "--timeout",
               str(args.timeout), "-n", str(args.workers), "--"] + worker_cmd
    lighthouse = None
    if args.peer == "torchft":
        os.environ.setdefault("RUST_LOG", "warn")
        from torchft.coordination import LighthouseServer

        lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1,
                                      join_timeout_ms=int(args.timeout * 1000))
        env["TORCHFT_LIGHTHOUSE"] = "http://127.0.0.1:" + lighthouse.address().rsplit(":", 1)[1]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env)
    lines = []
    pids = {}  # slot -> current pid
    lock = threading.Lock()
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = open(out / f"log-{args.peer}-{'faults' if faults else 'clean'}.txt", "w")

    def read():
        for line in proc.stdout:
            log.write(line)
            log.flush()
            with lock:
                lines.append(line)
                m = re.match(r"\[rank (\d+)\] STARTED slot \d+ pid (\d+)", line)
                if m:
                    pids[int(m.group(1))] = int(m.group(2))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    began = time.time()
    kills, stops = [], []
    if faults:
        # The faults start with training: the clock starts at the first commit.
        while proc.poll() is None and not any("] APPLIED" in line for line in lines[-50:]):
            time.sleep(0.1)
        trained = time.time()
        victim, stopped = 0, False
        next_kill = trained + args.kill_every
        while proc.poll() is None and not any("] FINAL" in line for line in lines[-20:]):
            time.sleep(0.2)
            now = time.time()
            if not stopped and now - trained > args.kill_every * 1.5:
                with lock:
                    pid = pids.get(args.workers - 1)
                if pid:
                    os.kill(pid, signal.SIGSTOP)
                    stops.append(now)
                    stopped = True
                    threading.Timer(args.timeout + 3, lambda p=pid: _signal(p, signal.SIGCONT)
                                    ).start()
            if now >= next_kill:
                with lock:
                    pid = pids.get(victim)
                if pid and _signal(pid, signal.SIGKILL):
                    kills.append((now, victim))
                victim = (victim + 1) % (args.workers - 1)  # the stopped one is spared
                next_kill += args.kill_every
    proc.wait(timeout=args.seconds * 10)
    reader.join(timeout=10)
    seconds = time.time() - began
    text = "".join(lines)
    log.close()
    if lighthouse is not None:
        lighthouse.shutdown()
    return analyse(text, seconds, kills, stops, args)


def _signal(pid: int, signo: int) -> bool:
    try:
        os.kill(pid, signo)
        return True
    except ProcessLookupError:
        return False


def analyse(text: str, seconds: float, kills, stops, args) -> dict:
    applied = collections.defaultdict(list)  # step -> [(pid, time)]
    for m in re.finditer(r"\] APPLIED (\d+) (\d+) ([\d.]+)", text):
        applied[int(m.group(1))].append((int(m.group(2)), float(m.group(3))))
    twice = sum(1 for rows in applied.values()
                if len([p for p, _ in rows]) != len({p for p, _ in rows}))
    never = sum(1 for s in range(args.steps) if s not in applied)
    finals = [(int(a), float(b), float(c))
              for a, b, c in re.findall(r"\] FINAL (\d+) ([\d.]+) ([\d.]+)", text)]
    commits = sorted(t for rows in applied.values() for _, t in rows)

    def cost(at: float) -> float:
        """The longest pause between two commits from the fault to 20 s after it (a commit of
        the step in flight may land after the fault; the pause comes at the next step)."""
        window = [t for t in commits if at - 1 <= t <= at + 20]
        return max((b - a for a, b in zip(window, window[1:])), default=0.0)

    costs = [cost(at) for at, _ in kills]
    stall_costs = [cost(at) for at in stops]
    starts, imported = {}, {}
    for p, t, i in re.findall(r"STARTED slot \d+ pid (\d+) at ([\d.]+) imported ([\d.]+)", text):
        starts[int(p)], imported[int(p)] = float(t), float(i)
    ready = {int(p): float(t) for p, t in re.findall(r"\] READY pid (\d+) at ([\d.]+)", text)}
    first_commit = {}
    for rows in applied.values():
        for pid, t in rows:
            first_commit[pid] = min(first_commit.get(pid, t), t)
    joins, phases = [], []
    initial = sorted(starts.values())[:args.workers]
    state_bytes = [json.loads(e).get("state_bytes", 0)
                   for e in re.findall(r"\] EVENT (\{.*\})", text)]
    for pid, t in starts.items():
        if t in initial or pid not in first_commit:
            continue
        joins.append(first_commit[pid] - t)
        # From its start: python and torch imported, data and model ready, first commit.
        phases.append((imported[pid] - t, ready.get(pid, t) - imported[pid],
                       first_commit[pid] - ready.get(pid, t)))
    return {"seconds": seconds, "train_seconds": commits[-1] - commits[0] if commits else 0,
            "finals": finals, "steps_twice": twice, "steps_never": never,
            "kills": len(kills), "stops": len(stops), "kill_costs": costs,
            "stall_costs": stall_costs, "join_seconds": joins, "join_phases": phases,
            "state_bytes": max(state_bytes or [0]),
            "restarts": text.count("starting it again"), "exit_ok": finals != []}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--steps", type=int, default=0, help="steps per run (0: from --seconds)")
    ap.add_argument("--seconds", type=float, default=150,
                    help="about how long the fault-free run should take (sets --steps)")
    ap.add_argument("--batch", type=int, default=768, help="the global batch (3 and 4 divide it)")
    ap.add_argument("--codec", default="none")
    ap.add_argument("--peer", default="terse", choices=["terse", "torchft", "floor"],
                    help="whose recovery runs the drill: terse.elastic or torchft's Manager "
                    "(floor: no communication, run by each drill anyway)")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--timeout", type=float, default=10)
    ap.add_argument("--kill-every", type=float, default=60)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--terse", default=str(REPO / "build" / "terse"))
    ap.add_argument("--link", default="",
                    help="run on emulated hosts (scripts/cluster.sh -e) whose links tbf shapes "
                    "to this rate (1gbit, 100mbit); default: every worker on loopback")
    ap.add_argument("--ranks-per-host", type=int, default=1,
                    help="with --link: workers per emulated host")
    ap.add_argument("--out", default="results/elastic")
    args = ap.parse_args()
    if args.link and args.peer == "torchft":
        ap.error("--link runs terse and the floor only: torchft's Lighthouse would have to run "
                 "inside host 0's namespace")
    if args.link and args.workers % args.ranks_per_host:
        ap.error("--ranks-per-host must divide --workers")
    if args.worker:
        return {"torchft": torchft_worker, "floor": floor_worker, "terse": worker}[args.peer](args)
    if args.steps == 0:
        probe = argparse.Namespace(**{**vars(args), "steps": 200})
        r = run_once(probe, faults=False)
        per_step = r["train_seconds"] / 199
        args.steps = max(200, int(args.seconds / per_step))
        print(f"probe: {per_step * 1e3:.1f} ms per step; {args.steps} steps",
              flush=True)
    rows = []
    for k in range(args.repeats):
        clean = run_once(args, faults=False)
        churn = run_once(args, faults=True)
        floor = run_once(argparse.Namespace(**{**vars(args), "peer": "floor"}), faults=False)
        row = {"clean": clean, "churn": churn, "floor": floor,
               "goodput": clean["seconds"] / churn["seconds"]}
        rows.append(row)
        c, f = clean["finals"][0], churn["finals"][0]
        print(f"drill {k + 1}: compute-only floor {floor['seconds']:.1f} s, fault-free "
              f"{clean['seconds']:.1f} s, with faults "
              f"{churn['seconds']:.1f} s ({churn['kills']} kills, {churn['stops']} stop, "
              f"{churn['restarts']} restarts): goodput {row['goodput']:.1%}; loss {c[1]:.4f} -> "
              f"{f[1]:.4f}, accuracy {c[2]:.2%} -> {f[2]:.2%}; steps twice "
              f"{churn['steps_twice']}, never {churn['steps_never']}; kill costs "
              f"{[round(x, 2) for x in churn['kill_costs']]} s; stall costs "
              f"{[round(x, 2) for x in churn['stall_costs']]} s; replacements in lock step "
              f"after {[round(x, 2) for x in churn['join_seconds']]} s from their start "
              f"(imports, data and model, joining: "
              f"{[tuple(round(v, 2) for v in p) for p in churn['join_phases']]}) "
              f"(state {churn['state_bytes'] / 1e6:.2f} MB)", flush=True)
    med = statistics.median
    summary = {
        "peer": args.peer, "steps": args.steps, "batch": args.batch, "codec": args.codec,
        "kill_every": args.kill_every, "timeout": args.timeout,
        "goodput": med(r["goodput"] for r in rows),
        "floor_over_clean": med(r["floor"]["seconds"] / r["clean"]["seconds"] for r in rows),
        "loss_clean": med(r["clean"]["finals"][0][1] for r in rows),
        "loss_churn": med(r["churn"]["finals"][0][1] for r in rows),
        "accuracy_clean": med(r["clean"]["finals"][0][2] for r in rows),
        "accuracy_churn": med(r["churn"]["finals"][0][2] for r in rows),
        "kill_cost_max": max(x for r in rows for x in r["churn"]["kill_costs"] or [0]),
        "stall_cost_max": max(x for r in rows for x in r["churn"]["stall_costs"] or [0]),
        "join_seconds_median": med([x for r in rows for x in r["churn"]["join_seconds"]] or [0]),
        "join_phases_median": [med([p[k] for r in rows for p in r["churn"]["join_phases"]] or [0])
                               for k in range(3)],
        "link": args.link or "loopback", "ranks_per_host": args.ranks_per_host,
        "steps_twice": sum(r["churn"]["steps_twice"] for r in rows),
        "steps_never": sum(r["churn"]["steps_never"] for r in rows),
    }
    print("median of {} drills: ".format(len(rows)) + json.dumps(summary), flush=True)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "drill.json").write_text(json.dumps({"summary": summary, "runs": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
