"""terse.Policy, the one policy of every front end: which tensors are compressed and with what,
its validation (one set of rules, each door's refusals with their reasons), its versioned
settings in checkpoints, and Engine.calibrate, which front ends call when the policy plans."""

import threading
from typing import Callable, List

import pytest

import terse
from terse.policy import BACKEND, FSDP, GENERIC, HOOK

TIMEOUT = 30.0


def run_ranks(n: int, body: Callable[[int], object]) -> List[object]:
    """Runs body(rank) on n threads (the binding releases the GIL while it waits)."""
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
        t.join(4 * TIMEOUT)
        assert not t.is_alive(), "a rank hung"
    if errors:
        raise errors[0]
    return results


def test_tensors_below_min_bytes_travel_raw_the_others_take_the_codec():
    policy = terse.Policy("onebit:ef=1", min_bytes=1024, strategy="sharded", partitions=2)
    assert not policy.compresses(1023) and policy.compresses(1024)
    raw = policy.options_for(1023, average=False)
    assert (raw.codec, raw.strategy, raw.partitions, raw.average) == ("none", "auto", 0, False)
    compressed = policy.options_for(4096)
    assert (compressed.codec, compressed.strategy, compressed.partitions) == (
        "onebit:ef=1", "sharded", 2)
    assert policy.spec_for("w") == "onebit:ef=1" and policy.specs() == ["onebit:ef=1"]
    assert policy.compressed_options("fp16", rows=8).rows == 8
    assert not policy.planned
    assert terse.Policy("auto").planned
    assert terse.Policy("none", all_gather_codec="auto", auto_codecs=["minmax8"],
                        door=FSDP).planned


def test_a_schedule_gives_each_tensor_its_level():
    schedule = terse.Accordion("powersgd:rank=1", "powersgd:rank=4")
    policy = terse.Policy(schedule, door=HOOK)
    assert policy.schedule is schedule
    assert policy.specs() == schedule.specs()
    assert policy.spec_for("w") == schedule.spec("w")
    assert policy.describe() == schedule.describe()
    # Doors without schedules refuse them.
    with pytest.raises(terse.InvalidArgument, match="codec must be a spec, not"):
        terse.Policy(schedule, door=FSDP)
    with pytest.raises(terse.InvalidArgument, match="terse.Accordion or terse.SparseWarmup"):
        terse.Policy(("fp16", "bf16"), door=HOOK)


def test_bad_knobs_fail_with_one_message_each():
    with pytest.raises(terse.InvalidArgument, match="min_bytes must be >= 0, not -1"):
        terse.Policy("fp16", min_bytes=-1)
    with pytest.raises(terse.SpecError, match="nosuch"):
        terse.Policy("nosuch")
    with pytest.raises(terse.SpecError, match="nosuch"):
        terse.Policy("auto", auto_codecs=["nosuch"])
    with pytest.raises(terse.SpecError, match="nosuch"):
        terse.Policy("auto:heavy", heavy_codecs=["nosuch"])
    with pytest.raises(terse.SpecError, match="nosuch"):
        terse.Policy("fp16", all_to_all_codec="nosuch")
    with pytest.raises(terse.SpecError, match="unknown strategy 'nosuch'"):
        terse.Policy("fp16", strategy="nosuch")
    with pytest.raises(terse.InvalidArgument, match="auto_codecs is for codec='auto'"):
        terse.Policy("fp16", auto_codecs=["fp16"])
    with pytest.raises(terse.InvalidArgument, match="heavy_codecs is for codec='auto'"):
        terse.Policy("fp16", heavy_codecs=["onebit:ef=1"], door=HOOK)
    with pytest.raises(terse.InvalidArgument, match="all_to_all_codec 'auto'"):
        terse.Policy("fp16", all_to_all_codec="auto")


def test_each_door_refuses_the_tiers_it_does_not_plan_and_says_why():
    # The hook plans both tiers; FSDP the light one; the backend none.
    terse.Policy("auto:heavy", door=HOOK)
    terse.Policy("auto", door=FSDP)
    with pytest.raises(terse.InvalidArgument, match="terse.fsdp: codec 'auto:heavy' is not "
                                                    "supported: its state takes no heavy tier"):
        terse.Policy("auto:heavy", door=FSDP)
    with pytest.raises(terse.InvalidArgument, match="terse.fsdp: codec 'auto:heavy'"):
        terse.Policy("none", all_gather_codec="auto:heavy", door=FSDP)
    for knob in ("codec", "all_gather_codec", "all_to_all_codec"):
        with pytest.raises(terse.InvalidArgument, match="terse backend: codec 'auto' is not "
                                                        "supported: .*name one"):
            terse.Policy(**{"codec": "fp16", knob: "auto"}, door=BACKEND)
    with pytest.raises(terse.InvalidArgument, match="heavy_codecs is for codec 'auto:heavy', "
                                                    "which it does not plan"):
        terse.Policy("auto", heavy_codecs=["onebit:ef=1"], door=FSDP)
    with pytest.raises(terse.InvalidArgument,
                       match="auto_codecs is for codec='auto' or all_gather_codec='auto'"):
        terse.Policy("fp16", auto_codecs=["fp16"], door=FSDP)


def test_fresh_gathers_take_stateless_codecs_only():
    terse.Policy("none", all_gather_codec="minmax8", door=FSDP)
    with pytest.raises(terse.InvalidArgument, match="'onebit:ef=1' keeps state"):
        terse.Policy("none", all_gather_codec="onebit:ef=1", door=FSDP)
    with pytest.raises(terse.InvalidArgument, match="must be given"):
        terse.Policy("none", all_gather_codec="auto", door=FSDP)
    with pytest.raises(terse.InvalidArgument, match="keep no state .*: onebit"):
        terse.Policy("none", all_gather_codec="auto", auto_codecs=["minmax8", "onebit:ef=1"],
                     door=FSDP)
    with pytest.raises(terse.InvalidArgument, match="'powersgd' keeps state"):
        terse.Policy("none", all_gather_codec="powersgd", door=FSDP)
    # A door whose gathers are not recomputed each time may keep state in them.
    terse.Policy("fp16", all_gather_codec="onebit:ef=1", door=BACKEND)


def test_settings_round_trip_and_what_differs_is_named():
    policy = terse.Policy("auto", auto_codecs=["fp16", "minmax8:ef=1"], min_bytes=4096)
    saved = policy.state_dict(rank=0, size=2)
    assert saved["version"] == 1 and saved["codec"] == "auto"
    assert (saved["rank"], saved["size"], saved["min_bytes"]) == (0, 2, 4096)
    assert saved["auto_codecs"] == [terse.canonical_spec("fp16"),
                                    terse.canonical_spec("minmax8:ef=1")]
    policy.load_state_dict(saved, rank=0, size=2)
    # Another policy of the same settings (another process, a resumed run) takes it.
    twin = terse.Policy("auto", auto_codecs=["fp16", "minmax8:ef=1"], min_bytes=4096)
    twin.load_state_dict(saved, rank=0, size=2)
    with pytest.raises(terse.DecodeError, match="my state: version 99, expected 1"):
        policy.load_state_dict(dict(saved, version=99), rank=0, size=2, what="my state")
    with pytest.raises(terse.MismatchError, match="rank 0: terse state was saved with "
                                                  "min_bytes=1, this one has min_bytes=4096"):
        policy.load_state_dict(dict(saved, min_bytes=1), rank=0, size=2)
    with pytest.raises(terse.MismatchError, match="auto_codecs"):
        policy.load_state_dict(dict(saved, auto_codecs=[]), rank=0, size=2)
    with pytest.raises(terse.MismatchError, match="rank=0, this one has rank=1"):
        policy.load_state_dict(saved, rank=1, size=2)
    with pytest.raises(terse.MismatchError, match="size=2, this one has size=4"):
        policy.load_state_dict(saved, rank=0, size=4)
    # Settings absent from an older checkpoint count as their defaults (or as `absent` says).
    old = {k: v for k, v in terse.Policy("fp16").state_dict(rank=0, size=1).items()
           if k not in ("heavy_codecs", "all_to_all_codec")}
    terse.Policy("fp16").load_state_dict(old, rank=0, size=1,
                                         settings={"warmup_steps": 0},
                                         absent={"warmup_steps": 0})
    with pytest.raises(terse.MismatchError, match="warmup_steps=None, this one has "
                                                  "warmup_steps=2"):
        terse.Policy("fp16").load_state_dict(old, rank=0, size=1,
                                             settings={"warmup_steps": 2},
                                             absent={"warmup_steps": 0})


def test_engine_options_carry_the_tiers():
    options = terse.Policy("auto:heavy", auto_codecs=["fp16"], heavy_codecs=["onebit:ef=1"],
                           door=HOOK).engine_options(threads=2, seed=3)
    assert options.auto_codecs == ["fp16"]
    assert options.heavy_codecs == [terse.canonical_spec("onebit:ef=1")]
    assert (options.threads, options.seed) == (2, 3)
    assert terse.Policy("fp16", door=GENERIC).engine_options().auto_codecs == []


def test_under_adam_the_default_tiers_keep_element_wise_quantizers_light(monkeypatch):
    monkeypatch.delenv("TERSE_PLAN_CODECS", raising=False)
    monkeypatch.delenv("TERSE_PLAN_HEAVY_CODECS", raising=False)
    light = [terse.canonical_spec(c) for c in terse.policy.ADAPTIVE_TIERS["auto"]]
    heavy = [terse.canonical_spec(c) for c in terse.policy.ADAPTIVE_TIERS["auto:heavy"]]
    assert not any(c.startswith("powersgd") for c in light)
    assert any(c.startswith("powersgd") for c in heavy)
    policy = terse.Policy("auto:heavy", door=HOOK, adaptive=True)
    assert (policy.auto_codecs, policy.heavy_codecs) == (light, heavy)
    # Empty lists ask for the default tiers, as None does.
    policy = terse.Policy("auto:heavy", auto_codecs=[], heavy_codecs=[], door=HOOK, adaptive=True)
    assert (policy.auto_codecs, policy.heavy_codecs) == (light, heavy)
    # The light tier alone does not calibrate a heavy one.
    assert terse.Policy("auto", door=HOOK, adaptive=True).heavy_codecs == []
    assert terse.Policy("auto", door=FSDP, adaptive=True).auto_codecs == light
    # What the user names wins: the knobs, then the environment.
    assert terse.Policy("auto", auto_codecs=["fp16"], door=HOOK,
                        adaptive=True).auto_codecs == ["fp16"]
    monkeypatch.setenv("TERSE_PLAN_CODECS", "fp16")
    assert terse.Policy("auto", door=HOOK, adaptive=True).auto_codecs == []
    # Nothing planned: nothing changes; without adaptive, the planner's defaults.
    assert terse.Policy("fp16", door=HOOK, adaptive=True).auto_codecs == []
    monkeypatch.delenv("TERSE_PLAN_CODECS")
    assert terse.Policy("auto", door=HOOK).auto_codecs == []
    with pytest.raises(terse.InvalidArgument, match="adaptive must be True or False"):
        terse.Policy("auto", door=HOOK, adaptive="adam")


def test_calibrate_is_a_collective_every_rank_calls_and_idempotent(tmp_path, monkeypatch):
    # The planner caches its calibration under XDG_CACHE_HOME: keep it out of the user's cache.
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    store = terse.file_store(str(tmp_path / "store"))
    policy = terse.Policy("auto", auto_codecs=["fp16"])

    def body(rank: int):
        comm = terse.Communicator(rank, 2, store, timeout=TIMEOUT)
        with terse.Engine(comm, policy.engine_options(threads=1)) as engine:
            policy.calibrate(engine)
            engine.calibrate()  # calibrated already: exchanges nothing
            # Planned alike on both ranks, without another exchange.
            return repr(engine.plan(1 << 16, codec="auto"))

    plans = run_ranks(2, body)
    assert plans[0] == plans[1], plans


def test_a_policy_that_plans_nothing_does_not_calibrate(tmp_path):
    class Recorder:
        calls = 0

        def calibrate(self) -> None:
            self.calls += 1

    engine = Recorder()
    terse.Policy("fp16").calibrate(engine)
    assert engine.calls == 0
    terse.Policy("auto").calibrate(engine)
    assert engine.calls == 1
