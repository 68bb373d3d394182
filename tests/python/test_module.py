"""terse._C without torch: codecs, errors, stores, Communicator and Engine on numpy buffers.

Multi-rank cases run two ranks as two threads of this process. That only works because the
binding releases the GIL while it connects and waits: were it held, the second rank could never
enter Communicator() and both would fail at the (short) timeout.
"""

import array
import gc
import os
import subprocess
import sys
import textwrap
import threading
import time
import weakref
from typing import Callable, List

import numpy as np
import pytest

import terse
from conftest import TERSE_CLI

TIMEOUT = 10.0


def run_ranks(n: int, body: Callable[[int], object]) -> List[object]:
    """Runs body(rank) on n threads; returns the results, re-raising the first error."""
    results: List[object] = [None] * n
    errors: List[BaseException] = []

    def target(rank: int) -> None:
        try:
            results[rank] = body(rank)
        except BaseException as e:  # noqa: B902 - reported to the test below
            errors.append(e)

    threads = [threading.Thread(target=target, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(3 * TIMEOUT)
        assert not t.is_alive(), "a rank hung"
    if errors:
        raise errors[0]
    return results


def one_rank_engine(tmp_path, **options) -> terse.Engine:
    comm = terse.Communicator(0, 1, terse.file_store(str(tmp_path)), timeout=TIMEOUT)
    return terse.Engine(comm, terse.EngineOptions(**options))


def test_codecs_are_listed_and_specs_canonical():
    names = terse.codec_names()
    for expected in ("none", "fp16", "bf16", "onebit", "powersgd", "qsgd"):
        assert expected in names
    assert names == sorted(names)
    assert all(c["summary"] and c["id"] >= 0 for c in terse.codecs())
    spec = terse.canonical_spec("onebit:ef=1")
    assert spec.startswith("onebit:") and "ef=1" in spec
    assert terse.canonical_spec(spec) == spec
    assert "sharded" in terse.strategies() and "auto" in terse.strategies()


def test_errors_form_a_hierarchy_with_the_cpp_text():
    for cls in (terse.SpecError, terse.InvalidArgument, terse.DecodeError, terse.MismatchError,
                terse.TimeoutError, terse.TransportError):
        assert issubclass(cls, terse.Error)
        assert cls.__module__ == "terse"
    assert issubclass(terse.Error, RuntimeError)
    assert issubclass(terse.TimeoutError, TimeoutError)
    assert issubclass(terse.TransportError, ConnectionError)
    assert issubclass(terse.AuthenticationError, terse.TransportError)
    assert terse.AuthenticationError.__module__ == "terse"
    assert issubclass(terse.SpecError, ValueError)
    with pytest.raises(terse.SpecError) as e:
        terse.canonical_spec("nope:x=1")
    assert "unknown codec 'nope'" in str(e.value) and "fp16" in str(e.value)
    with pytest.raises(terse.SpecError, match="unknown strategy 'diagonal'"):
        terse.AllreduceOptions(codec="fp16", strategy="diagonal")


def test_rows_give_auto_the_matrix_view_and_must_divide_the_tensor(tmp_path):
    o = terse.AllreduceOptions(codec="auto", rows=64)
    assert o.rows == 64 and "rows=64" in repr(o)
    assert "rows" not in repr(terse.AllreduceOptions(codec="auto"))
    with one_rank_engine(tmp_path) as engine:
        # Refused before the planner is asked (no calibration runs).
        with pytest.raises(terse.InvalidArgument, match="rows=3 does not divide the tensor's 1000"):
            engine.plan(1000, codec="auto", rows=3)
        with pytest.raises(terse.InvalidArgument, match="rows=2000 does not divide"):
            engine.plan(1000, codec="auto", rows=2000)


def test_one_rank_allreduce_in_place(tmp_path):
    with one_rank_engine(tmp_path) as engine:
        assert (engine.rank, engine.size) == (0, 1)
        x = np.linspace(-1, 1, 1000, dtype=np.float32)
        original = x.copy()
        engine.allreduce("exact", x).wait()
        np.testing.assert_array_equal(x, original)
        # fp16 rounds in place: the result is the input rounded to half precision.
        engine.allreduce("half", x, codec="fp16").wait()
        np.testing.assert_array_equal(x, original.astype(np.float16).astype(np.float32))
        assert not np.array_equal(x, original)
        # Any writable float32 buffer works, e.g. array('f').
        a = array.array("f", [1.0, 2.0, 3.0])
        engine.allreduce("array", a).wait()
        assert list(a) == [1.0, 2.0, 3.0]
    assert engine.closed
    with pytest.raises(terse.InvalidArgument, match="after close"):
        engine.allreduce("late", x)


def test_bad_tensors_are_rejected_naming_them(tmp_path):
    with one_rank_engine(tmp_path) as engine:
        with pytest.raises(TypeError, match="tensor 'd'.*float32"):
            engine.allreduce("d", np.zeros(4, dtype=np.float64))
        with pytest.raises(terse.InvalidArgument, match="tensor 's'.*not C-contiguous"):
            engine.allreduce("s", np.zeros((4, 4), dtype=np.float32)[:, 1])
        read_only = np.zeros(4, dtype=np.float32)
        read_only.flags.writeable = False
        with pytest.raises(terse.InvalidArgument, match="tensor 'r': not a writable buffer"):
            engine.allreduce("r", read_only)
        with pytest.raises(TypeError, match="tensor 'l'"):
            engine.allreduce("l", [1.0, 2.0])
        with pytest.raises(terse.SpecError):
            engine.allreduce("c", np.zeros(4, dtype=np.float32), codec="nope")
        with pytest.raises(terse.InvalidArgument, match="strategy raw"):
            engine.allreduce("c", np.zeros(4, dtype=np.float32), codec="fp16", strategy="raw")


def test_errors_reach_wait_and_on_complete_with_their_type(tmp_path):
    with one_rank_engine(tmp_path) as engine:
        x = np.ones(256, dtype=np.float32)
        x[17] = np.nan
        seen = []
        handle = engine.allreduce("bad", x, codec="fp16")
        handle.on_complete(seen.append)
        with pytest.raises(terse.InvalidArgument) as e:
            handle.wait()
        assert "tensor 'bad'" in str(e.value) and "element 17" in str(e.value)
        assert handle.ready()
        # wait() returns once the handle is done; its callbacks run after that, on the engine's
        # completion thread (which needs the GIL): give it a bounded time.
        deadline = time.monotonic() + 10
        while not seen and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(seen) == 1 and type(seen[0]) is terse.InvalidArgument
        assert str(seen[0]) == str(e.value)
        # Success reports None, and a callback added after completion runs at once.
        ok = engine.allreduce("good", np.ones(8, dtype=np.float32))
        ok.wait()
        ok.on_complete(seen.append)
        assert seen[1] is None


def test_plans_and_auto(tmp_path):
    with one_rank_engine(tmp_path) as engine:
        plan = engine.plan(1 << 20, codec="onebit:ef=1")
        assert plan.strategy == "sharded" and plan.codec.startswith("onebit")
        assert engine.plan(1 << 20, codec="fp16").strategy == "summable"
        # Until the planner exists, "auto" reduces raw fp32.
        auto = engine.plan(1000, codec="auto")
        assert (auto.codec, auto.strategy) == ("none", "raw")
        assert engine.plan(1 << 24, codec="none", partitions=3).partitions == 3


def test_state_round_trips_and_rejects_garbage(tmp_path):
    with one_rank_engine(tmp_path) as engine:
        x = np.random.default_rng(0).standard_normal(4096).astype(np.float32)
        engine.allreduce("w", x, codec="onebit:ef=1").wait()
        state = engine.save_state()
        assert isinstance(state, bytes) and len(state) > 4096 * 4  # holds the residual
        engine.load_state(state)
        assert engine.save_state() == state
        with pytest.raises(terse.DecodeError, match="engine state"):
            engine.load_state(b"garbage")
        assert engine.save_state() == state  # unchanged


def test_submitted_buffers_are_released_after_completion(tmp_path):
    class Buffer(bytearray):  # bytearray itself has no weak references
        pass

    with one_rank_engine(tmp_path) as engine:
        b = Buffer(np.ones(64, dtype=np.float32).tobytes())
        view = memoryview(b).cast("f")
        ref = weakref.ref(b)
        engine.allreduce("b", view).wait()
        view.release()
        del view, b
        gc.collect()
        assert ref() is None


def test_two_ranks_in_two_threads_over_a_file_store(tmp_path):
    store = terse.file_store(str(tmp_path))
    rng = np.random.default_rng(1)
    inputs = [rng.standard_normal(10000).astype(np.float32) for _ in range(2)]

    def rank(r: int):
        comm = terse.Communicator(r, 2, store, timeout=TIMEOUT)
        with terse.Engine(comm, terse.EngineOptions(threads=2)) as engine:
            exact = inputs[r].copy()
            half = inputs[r].copy()
            h1 = engine.allreduce("exact", exact)
            h2 = engine.allreduce_group([("half", half, terse.AllreduceOptions(codec="fp16"))])
            h1.wait()
            h2.wait()
            sent = engine.bytes_sent
            comm.barrier("end")
        return exact, half, sent

    (e0, f0, s0), (e1, f1, s1) = run_ranks(2, rank)
    np.testing.assert_array_equal(e0, e1)  # bit-identical on both ranks
    np.testing.assert_array_equal(f0, f1)
    np.testing.assert_array_equal(e0, (inputs[0] + inputs[1]) / 2)
    np.testing.assert_allclose(f0, (inputs[0] + inputs[1]) / 2, rtol=2e-3, atol=2e-3)
    assert s0 > 0 and s1 > 0


def test_a_state_saved_by_another_rank_is_refused_naming_both_ranks(tmp_path):
    store = terse.file_store(str(tmp_path))
    states = [b"", b""]
    ready = threading.Barrier(2)

    def rank(r: int):
        comm = terse.Communicator(r, 2, store, timeout=TIMEOUT)
        with terse.Engine(comm) as engine:
            x = np.random.default_rng(r).standard_normal(4096).astype(np.float32)
            engine.allreduce("w", x, codec="onebit:ef=1").wait()
            states[r] = engine.save_state()
            ready.wait(TIMEOUT)
            with pytest.raises(terse.MismatchError) as refused:
                engine.load_state(states[1 - r])
            engine.load_state(states[r])  # its own still loads
            assert engine.save_state() == states[r]
            comm.barrier("end")
        return str(refused.value)

    for r, message in enumerate(run_ranks(2, rank)):
        assert f"saved by rank {1 - r} of 2 ranks" in message, message
        assert f"this engine is rank {r} of 2" in message, message


# Each rank makes communicators from the environment the way terse.torch.communicator() does:
# a second one (another prefix) while the first lives, then, with both deleted, two more with the
# default prefix; each passes a barrier with the other rank.
_FROM_ENV_AGAIN = textwrap.dedent("""
    import gc
    import terse

    def check(comm):
        assert comm.size == 2 and not comm.failed
        comm.barrier()  # messages both ways with the other rank

    first = terse.Communicator.from_env(timeout=20, prefix="comm-0")
    second = terse.Communicator.from_env(timeout=20, prefix="comm-1")
    check(first)
    check(second)
    del first, second
    gc.collect()
    for _ in range(2):
        again = terse.Communicator.from_env(timeout=20)
        check(again)
        del again
        gc.collect()
    print("FROM-ENV-OK", terse.bootstrap_from_env()[0], flush=True)
""")


@pytest.mark.parametrize("store", ["tcp", "file"])
def test_from_env_can_be_called_again_in_one_process(tmp_path, store):
    env = dict(os.environ)
    if store == "file":
        env["TERSE_FILE_STORE"] = str(tmp_path / "store")
    proc = subprocess.run(
        [TERSE_CLI, "run", "-n", "2", "--", sys.executable, "-c", _FROM_ENV_AGAIN],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stdout
    for r in range(2):
        assert f"[rank {r}] FROM-ENV-OK {r}" in proc.stdout, proc.stdout


class DictStore:
    """A store in plain Python, shaped like torch.distributed.Store (set/get/wait)."""

    def __init__(self) -> None:
        self.values = {}
        self.cv = threading.Condition()
        self.calls = 0

    def set(self, key: str, value: bytes) -> None:
        with self.cv:
            self.calls += 1
            self.values[key] = bytes(value)
            self.cv.notify_all()

    def get(self, key: str) -> bytes:
        with self.cv:
            self.calls += 1
            return self.values[key]

    def wait(self, keys, timeout) -> None:
        with self.cv:
            self.calls += 1
            if not self.cv.wait_for(lambda: all(k in self.values for k in keys),
                                    timeout.total_seconds()):
                raise RuntimeError(f"keys {keys} not set in time")


def test_a_python_store_bootstraps_two_ranks(tmp_path):
    backing = DictStore()
    store = terse.prefix_store("job", terse.python_store(backing))

    def rank(r: int):
        comm = terse.Communicator(r, 2, store, timeout=TIMEOUT)
        x = np.full(100, float(r + 1), dtype=np.float32)
        with terse.Engine(comm) as engine:
            engine.allreduce("x", x, average=False).wait()
        return x

    a, b = run_ranks(2, rank)
    np.testing.assert_array_equal(a, np.full(100, 3.0, dtype=np.float32))
    np.testing.assert_array_equal(a, b)
    assert backing.calls > 0 and all(k.startswith("job/") for k in backing.values)
    # The store interface itself, through the adapter.
    store.set("k", b"v")
    assert store.get("k") == b"v"
    with pytest.raises(terse.TimeoutError, match="missing"):
        store.wait(["missing"], timeout=0.2)


def test_a_tcp_store_admits_only_the_job_secret(monkeypatch):
    monkeypatch.delenv("TERSE_JOB_SECRET", raising=False)
    server = terse.tcp_store("127.0.0.1", 0, True, timeout=5, secret="job secret")
    client = terse.tcp_store("127.0.0.1", server.port, False, timeout=5, secret="job secret")
    client.set("k", b"v")
    assert server.get("k") == b"v"
    with pytest.raises(terse.AuthenticationError, match="did not match"):
        terse.tcp_store("127.0.0.1", server.port, False, timeout=5, secret="another")
    with pytest.raises(terse.AuthenticationError, match="this process has none"):
        terse.tcp_store("127.0.0.1", server.port, False, timeout=5)
    # None: the environment's secret.
    monkeypatch.setenv("TERSE_JOB_SECRET", "job secret")
    terse.tcp_store("127.0.0.1", server.port, False, timeout=5).set("env", b"ok")
    assert server.get("env") == b"ok"


def test_ranks_with_different_secrets_fail_naming_each_other(tmp_path, monkeypatch):
    monkeypatch.delenv("TERSE_JOB_SECRET", raising=False)
    store = terse.file_store(str(tmp_path))

    def rank(r: int):
        with pytest.raises(terse.AuthenticationError) as refused:
            terse.Communicator(r, 2, store, timeout=TIMEOUT, secret=f"secret of rank {r}")
        return str(refused.value)

    for r, message in enumerate(run_ranks(2, rank)):
        assert f"peer {1 - r} did not prove the job secret" in message, message


def test_a_missing_rank_times_out_naming_it(tmp_path):
    start = time.monotonic()
    with pytest.raises(terse.TimeoutError):
        terse.Communicator(0, 2, terse.file_store(str(tmp_path)), timeout=1.0)
    assert time.monotonic() - start < 10


def test_an_object_without_store_methods_is_refused():
    with pytest.raises(terse.InvalidArgument, match="wait"):
        terse.python_store(object())


RELEASED_BY_ITS_CALLBACK = """
import sys, threading, time
import numpy as np
import terse

comm = terse.Communicator(0, 1, terse.file_store(sys.argv[1]), timeout=30)
box = [terse.Engine(comm, terse.EngineOptions(threads=1))]
seen = []

def release(error):
    seen.append(threading.current_thread() is not threading.main_thread())
    box.clear()  # the engine's last reference, dropped on its own completion thread

handle = box[0].allreduce("x", np.ones(1 << 22, dtype=np.float32), codec="fp16")
handle.on_complete(release)
del handle
deadline = time.monotonic() + 20
while not seen and time.monotonic() < deadline:
    time.sleep(0.01)
time.sleep(0.5)  # the engine's deletion, handed to a thread of its own
print("seen", seen)
"""


def test_an_engine_released_by_its_own_callback_is_closed_without_a_crash(tmp_path):
    # The engine's destructor joins its threads: run on one of them (the last reference dropped
    # inside a completion callback, or by the garbage collector there) it must not join itself.
    proc = subprocess.run([sys.executable, "-c", RELEASED_BY_ITS_CALLBACK, str(tmp_path)],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=120, env=os.environ)
    assert proc.returncode == 0, proc.stdout
    assert "seen [True]" in proc.stdout, proc.stdout
