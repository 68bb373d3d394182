"""The hook's codec schedules: terse.Accordion's level decisions (unit tests on synthetic norms),
its bad inputs, the engine's hand-over of codec state when a tensor's spec changes, and real
multi-process DDP runs (ranks started by `terse run`) that switch levels together and resume
from a checkpoint bit for bit; terse.SparseWarmup's density schedule."""

import pathlib
import threading
from typing import Callable, List

import pytest
import torch

import terse
from conftest import launch
import accordion_worker

WORKER = pathlib.Path(__file__).resolve().parent / "accordion_worker.py"
TIMEOUT = 10.0

R1 = terse.canonical_spec("powersgd:rank=1")
R4 = terse.canonical_spec("powersgd:rank=4")


# ---- the controller ---------------------------------------------------------------------------


def test_the_first_two_windows_are_light_then_the_norm_change_decides():
    a = terse.Accordion("powersgd:rank=1", "powersgd:rank=4", eta=0.5)
    assert a.spec("w") == R4  # nothing known: critical
    a.end_window({"w": 10.0})  # nothing to compare with: critical
    assert a.spec("w") == R4
    a.end_window({"w": 9.0})  # -10%: regular
    assert a.spec("w") == R1
    a.end_window({"w": 4.5})  # -50%: critical (>= eta)
    assert a.spec("w") == R4
    a.end_window({"w": 4.6})  # +2%: regular
    assert a.spec("w") == R1
    a.end_window({"w": 9.2})  # +100%: critical
    assert a.spec("w") == R4
    assert a.windows == 5


def test_each_tensor_has_its_own_level():
    a = terse.Accordion("topk:ratio=0.01,ef=1", "topk:ratio=0.1,ef=1", eta=0.3)
    a.end_window({"a": 1.0, "b": 1.0})
    a.end_window({"a": 1.2, "b": 1.4})  # a: +20% regular, b: +40% critical
    assert a.spec("a") == a.heavy and a.spec("b") == a.light
    assert a.spec("never seen") == a.light


def test_a_learning_rate_drop_makes_every_tensor_light_until_the_window_ends():
    a = terse.Accordion("powersgd:rank=1", "powersgd:rank=4")
    for norm in (1.0, 1.0):
        a.end_window({"a": norm, "b": norm})
    assert a.spec("a") == a.spec("b") == R1
    a.lr_dropped()
    assert a.spec("a") == a.spec("b") == R4
    a.end_window({"a": 1.0, "b": 0.2})  # a regular, b critical: the rule decides again
    assert a.spec("a") == R1 and a.spec("b") == R4


def test_a_zero_norm_after_a_zero_norm_is_regular_and_after_a_nonzero_one_critical():
    a = terse.Accordion("powersgd:rank=1", "powersgd:rank=4")
    a.end_window({"w": 0.0})
    a.end_window({"w": 0.0})
    assert a.spec("w") == R1
    a.end_window({"w": 1.0})
    assert a.spec("w") == R4


def test_controller_state_round_trips():
    a = terse.Accordion("powersgd:rank=1", "powersgd:rank=4", window_steps=5)
    a.end_window({"a": 1.0, "b": 2.0})
    a.end_window({"a": 1.1, "b": 0.5})
    b = terse.Accordion("powersgd:rank=1", "powersgd:rank=4", window_steps=5)
    b.load_state_dict(a.state_dict())
    for norms in ({"a": 1.0, "b": 0.4}, {"a": 3.0, "b": 0.41}):
        a.end_window(norms)
        b.end_window(norms)
        assert [a.spec(n) for n in "ab"] == [b.spec(n) for n in "ab"]
    other = terse.Accordion("powersgd:rank=1", "powersgd:rank=4", window_steps=6)
    with pytest.raises(terse.MismatchError, match="window=6 steps"):
        other.load_state_dict(a.state_dict())


@pytest.mark.parametrize("heavy, light, message", [
    ("powersgd:rank=1", "topk:ratio=0.1", "one codec family"),
    ("qsgd:levels=4", "terngrad", "one codec family"),
    ("powersgd:rank=4", "powersgd:rank=1", "must compress more"),
    ("topk:ratio=0.1", "topk:ratio=0.1", "both levels"),
    ("auto:heavy", "fp16", "one codec family"),
    ("onebit:ef=1", "auto", "one codec family"),
    ("auto", "auto:heavy", "swap them"),
    ("auto", "auto", "both levels"),
])
def test_levels_that_are_not_a_heavy_and_a_light_spec_of_one_family_are_refused(
        heavy, light, message):
    with pytest.raises(terse.InvalidArgument, match=message):
        terse.Accordion(heavy, light)


def test_levels_across_onebit_and_fp16_are_one_family():
    a = terse.Accordion("onebit:ef=1", "fp16")
    assert a.heavy.startswith("onebit") and a.light == "fp16"


def test_codec_autos_tiers_are_one_family():
    a = terse.Accordion("auto:heavy", "auto")
    assert (a.heavy, a.light) == ("auto:heavy", "auto")
    assert terse.accordion.codec_family("auto") == terse.accordion.codec_family("auto:heavy")
    assert a.specs() == ["auto:heavy", "auto"]


@pytest.mark.parametrize("eta", [0, 1, -0.1, 1.5, float("nan"), True])
def test_an_eta_outside_zero_one_is_refused(eta):
    with pytest.raises(terse.InvalidArgument, match="eta must be in"):
        terse.Accordion("powersgd:rank=1", "powersgd:rank=4", eta=eta)


@pytest.mark.parametrize("window", [0, -3, 2.5])
def test_a_window_of_no_steps_is_refused(window):
    with pytest.raises(terse.InvalidArgument, match="window_steps must be"):
        terse.Accordion("powersgd:rank=1", "powersgd:rank=4", window_steps=window)
    with pytest.raises(terse.InvalidArgument, match="window_steps must be"):
        terse.SparseWarmup("dgc", window_steps=window)


def test_sparse_warmup_ramps_the_density_as_dgc_does():
    w = terse.SparseWarmup("dgc:ratio=0.001", stages=4)
    ratios = [w.ratio_of(k) for k in range(6)]
    assert ratios == [0.25, 0.0625, 0.015625, 0.00390625, 0.001, 0.001]
    assert w.spec_of(0) == terse.canonical_spec("dgc:ratio=0.25")
    assert w.spec_of(4) == terse.canonical_spec("dgc:ratio=0.001")
    # Never below the target: top-k 1% reaches it in the third window.
    t = terse.SparseWarmup("topk:ratio=0.01,ef=1", stages=4)
    assert [t.ratio_of(k) for k in range(4)] == [0.25, 0.0625, 0.015625, 0.01]
    assert t.spec_of(1) == "topk:ratio=0.0625,ef=1"
    with pytest.raises(terse.InvalidArgument, match="not a sparsifier"):
        terse.SparseWarmup("powersgd")


def test_a_hook_refuses_what_is_neither_a_spec_nor_a_schedule_before_connecting():
    import terse.torch

    with pytest.raises(terse.InvalidArgument, match="terse.Accordion or terse.SparseWarmup"):
        terse.torch.TerseHookState(codec=("powersgd:rank=1", "powersgd:rank=4"))
    with pytest.raises(terse.InvalidArgument, match="clip_norm must be > 0"):
        terse.torch.TerseHookState(codec="dgc", clip_norm=0.0)
    with pytest.raises(terse.InvalidArgument, match="auto_codecs is for codec='auto'"):
        terse.torch.TerseHookState(codec=terse.Accordion("powersgd:rank=1", "powersgd:rank=4"),
                                   auto_codecs=["fp16"])
    with pytest.raises(terse.InvalidArgument, match="heavy_codecs is for codec='auto'"):
        terse.torch.TerseHookState(codec="fp16", heavy_codecs=["onebit:ef=1"])
    with pytest.raises(terse.SpecError):
        terse.torch.TerseHookState(codec="auto:heavy", heavy_codecs=["nosuchcodec"])


# ---- the engine hands codec state over when a tensor's spec changes --------------------------


def run_two_ranks(tmp_path, body: Callable[[terse.Engine, int], object]) -> List[object]:
    store = terse.file_store(str(tmp_path))
    results: List[object] = [None, None]
    errors: List[BaseException] = []

    def target(rank: int) -> None:
        try:
            comm = terse.Communicator(rank, 2, store, timeout=TIMEOUT)
            with terse.Engine(comm, terse.EngineOptions(threads=1)) as engine:
                results[rank] = body(engine, rank)
        except BaseException as e:  # noqa: B902 - reported below
            errors.append(e)

    threads = [threading.Thread(target=target, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(6 * TIMEOUT)
        assert not t.is_alive(), "a rank hung"
    if errors:
        raise errors[0]
    return results


@pytest.mark.parametrize("first, second, other", [
    ("topk:ratio=0.01,ef=1", "topk:ratio=0.1,ef=1", "allgather"),
    ("randomk:ratio=0.01,ef=1", "randomk:ratio=0.1,ef=1", "allgather"),
    ("dgc:ratio=0.01", "dgc:ratio=0.05", "sharded"),
    ("powersgd:rank=1", "powersgd:rank=4", "allgather"),
    ("qsgd:levels=4,ef=1", "qsgd:levels=16,ef=1", "allgather"),
])
def test_a_new_spec_of_one_codec_takes_over_the_residual(tmp_path, first, second, other):
    # One step of the first spec leaves a residual (what it did not send); a step of zeros under
    # the second spec then sends part of it, where a fresh state sends nothing. The control: the
    # same steps with a change of strategy too (`other`, not the codec's auto one: another slot
    # layout) start fresh.
    strategy = "auto"
    def body(engine: terse.Engine, rank: int):
        g = torch.Generator().manual_seed(rank)
        x = torch.randn(64 * 64, generator=g)
        sent = {}
        for name, then in (("carried", strategy), ("control", other)):
            engine.allreduce(name, x.clone(), codec=first, strategy=strategy).wait()
            zeros = torch.zeros_like(x)
            engine.allreduce(name, zeros, codec=second, strategy=then).wait()
            sent[name] = float(zeros.abs().sum())
        return sent

    for sent in run_two_ranks(tmp_path, body):
        assert sent["carried"] > 0, sent
        assert sent["control"] == 0, sent


def test_the_step_count_continues_across_a_spec_change(tmp_path):
    # The step keys stochastic codecs' streams: a switch must not replay step 0's indices.
    def body(engine: terse.Engine, rank: int):
        x = torch.arange(1, 4097, dtype=torch.float32)
        for _ in range(3):
            engine.allreduce("t", x.clone(), codec="randomk:ratio=0.1").wait()
        state = engine.save_state()
        engine.allreduce("t", x.clone(), codec="randomk:ratio=0.2").wait()
        return state, engine.save_state()

    def step_of(state: bytes) -> int:
        # The record's step follows its config string, which ends "..., average".
        at = state.index(b", average") + len(b", average")
        return int.from_bytes(state[at:at + 8], "little")

    for before, after in run_two_ranks(tmp_path, body):
        assert step_of(before) == 3
        assert step_of(after) == 4  # a fresh state would be at 1


# ---- multi-process DDP runs -------------------------------------------------------------------


@pytest.fixture(scope="module")
def levels(tmp_path_factory):
    return launch(3, ["levels"], tmp_path_factory.mktemp("levels"), worker=WORKER)


def test_every_rank_switches_at_the_same_step_to_the_same_level(levels):
    specs = [r["specs"] for r in levels]
    assert specs[0] == specs[1] == specs[2]
    assert len({r["digest"] for r in levels}) == 1, "replicas differ"
    per_step = specs[0]
    used = {spec.split(",rows=")[0] for step in per_step for spec in step.values()}
    assert any("rank=1" in s for s in used) and any("rank=4" in s for s in used), used
    # Levels change only where a window ends (every WINDOW steps) or at the learning-rate drop.
    window, drop = accordion_worker.WINDOW, accordion_worker.LR_DROP
    for i in range(1, len(per_step)):
        if per_step[i] != per_step[i - 1]:
            assert i % window == 0 or i == drop, (i, per_step[i - 1], per_step[i])
    # The first two windows are light; the drop makes every parameter light.
    assert all("rank=4" in s for step in per_step[:2 * window] for s in step.values())
    assert all("rank=4" in s for s in per_step[drop].values())


def test_accordion_over_auto_switches_tiers_together_and_auto_keeps_to_the_light_tier(tmp_path):
    results = launch(2, ["auto"], tmp_path, worker=WORKER)
    a, b = results
    assert a["specs"] == b["specs"] and a["plans"] == b["plans"]
    assert a["digest"] == b["digest"], "replicas differ"
    assert "heavy_codecs" in a["saved"]
    specs, plans = a["specs"], a["plans"]
    levels = {level for step in specs for level in step.values()}
    assert levels == {"auto", "auto:heavy"}, levels
    window, drop = accordion_worker.WINDOW, accordion_worker.LR_DROP
    for i in range(1, len(specs)):
        if specs[i] != specs[i - 1]:
            assert i % window == 0 or i == drop, (i, specs[i - 1], specs[i])
    # Light, heavy, light again at the learning-rate drop: both switches.
    assert all(level == "auto" for step in specs[:2 * window] for level in step.values())
    assert any(level == "auto:heavy" for level in specs[drop - 1].values()), specs[drop - 1]
    assert all(level == "auto" for level in specs[drop].values()), specs[drop]
    # Codec "auto" plans within the light tier alone; "auto:heavy" within both.
    for level, plan in ((level, plans[i][name]) for i, step in enumerate(specs)
                        for name, level in step.items()):
        allowed = {a["light"]} if level == "auto" else {a["light"], a["heavy"]}
        assert plan in allowed, (level, plan)


def test_warmup_steps_the_density_down_window_by_window(tmp_path):
    results = launch(2, ["warmup"], tmp_path, worker=WORKER)
    assert results[0]["specs"] == results[1]["specs"]
    assert results[0]["digest"] == results[1]["digest"]
    window = accordion_worker.WINDOW
    ratios = [{s.split("ratio=")[1].split(",")[0] for s in step.values()}
              for step in results[0]["specs"]]
    assert ratios == [{"0.25"}] * window + [{"0.0625"}] * window + [{"0.01"}] * 2 * window


def test_resume_under_accordion_is_bit_identical(tmp_path):
    checkpoints = tmp_path / "checkpoints"
    checkpoints.mkdir()
    saved = launch(3, ["resume", "save", "--checkpoint", str(checkpoints)], tmp_path / "save",
                   worker=WORKER)
    loaded = launch(3, ["resume", "load", "--checkpoint", str(checkpoints)], tmp_path / "load",
                    worker=WORKER)
    for s, l in zip(saved, loaded):
        assert l["resumed"] == s["continued"]
        # Control: without the hook state (levels, window sums, residuals) the run differs.
        assert l["resumed_without_hook_state"] != s["continued"]


def test_local_clipping_bounds_each_compressed_gradient_before_it_is_averaged(tmp_path):
    results = launch(2, ["clip"], tmp_path, worker=WORKER)
    limit = accordion_worker.CLIP / 2 ** 0.5
    clipped, plain, raw = results[0][str(accordion_worker.CLIP)], results[0]["None"], \
        results[0]["raw"]
    for name, norm in clipped.items():
        if name in raw:  # small parameters travel raw and are not clipped
            assert norm == plain[name], name
        else:
            assert plain[name] > 10 * limit, name  # the control: clipping had work to do
            assert 0 < norm <= limit * (1 + 1e-5), (name, norm, limit)


def test_ranks_whose_accordion_settings_differ_fail_on_every_rank(tmp_path):
    results = launch(3, ["disagree"], tmp_path, worker=WORKER)
    for r in results:
        assert r["failed"] and r["error_type"] == "MismatchError", r
        assert "schedules differ" in r["error"], r
        assert "eta=0.5" in r["error"] and "eta=0.6" in r["error"], r
