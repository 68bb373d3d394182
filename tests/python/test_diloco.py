"""terse.diloco: DiLoCo and Streaming DiLoCo in real multi-process training (ranks started by
`terse run`, Gloo process group, Fashion-MNIST, each rank its own batches)."""

import pytest
import torch

import terse
import terse.diloco
from conftest import HERE, launch, read_results, start_ranks

WORKER = HERE / "diloco_worker.py"
CONFIGS = ["diloco", "diloco-minmax4", "streaming", "streaming-raw"]


@pytest.fixture(scope="module")
def run2(tmp_path_factory):
    return launch(2, ["all"], tmp_path_factory.mktemp("diloco2"), worker=WORKER)


@pytest.fixture(scope="module")
def run4(tmp_path_factory):
    return launch(4, ["replicas"], tmp_path_factory.mktemp("diloco4"), worker=WORKER)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("config", CONFIGS)
def test_global_parameters_are_bit_identical_after_every_outer_step(world, config, run2, run4):
    records = [r["replicas"][config] for r in (run2 if world == 2 else run4)]
    first = records[0]
    assert first["outer_steps"][-1] >= 3, "the run must take several outer steps"
    for step, outer in enumerate(first["outer_steps"]):
        assert all(r["outer_steps"][step] == outer for r in records)
        assert len({r["global"][step] for r in records}) == 1, f"{config}: step {step + 1}"
    assert len({r["final_global"] for r in records}) == 1
    # Between outer steps every worker trains on its own data: the local replicas differ.
    assert len({r["local"][0] for r in records}) == world
    plain = config.startswith("diloco")
    for step in range(len(first["local"])):
        merged = first["outer_steps"][step] > (first["outer_steps"][step - 1] if step else 0)
        if plain and merged:  # replaced by the global parameters, the same everywhere
            assert len({r["local"][step] for r in records}) == 1
            assert first["local"][step] == first["global"][step]


def test_a_worker_can_be_a_host_of_ranks_training_with_ddp(run4):
    # 2 hosts of 2 ranks: DDP inside each host, DiLoCo across hosts (4-bit pseudo-gradients).
    records = [r["hosts"] for r in run4]
    assert [r["workers"] for r in records] == [2, 2, 2, 2]
    first = records[0]
    assert first["outer_steps"][-1] >= 3, "the run must take several outer steps"
    for step in range(len(first["global"])):
        assert len({r["global"][step] for r in records}) == 1, f"global, step {step + 1}"
        # DDP keeps a host's ranks equal; the hosts differ between outer steps.
        assert records[0]["local"][step] == records[1]["local"][step]
        assert records[2]["local"][step] == records[3]["local"][step]
    assert records[0]["local"][0] != records[2]["local"][0]
    assert len({r["final_global"] for r in records}) == 1
    assert len({r["final_local"] for r in records}) == 1
    assert first["final_local"] == first["final_global"]


def test_fragments_are_contiguous_runs_on_staggered_offsets(run2):
    streaming = run2[0]["replicas"]["streaming"]
    assert streaming["offsets"] == [2, 4, 0]
    names = [n for f in streaming["fragments"] for n in f]
    assert names == ["0.weight", "0.bias", "2.weight", "2.bias", "4.weight", "4.bias"]
    assert all(streaming["fragments"])
    # 26 steps at H 6: fragment 0 syncs at 8, 14, 20, 26; 1 at 10, 16, 22; 2 at 6, 12, 18, 24.
    assert streaming["outer_steps"][-1] == 10  # the exchange started at 26 is in flight


def test_streaming_hides_part_of_the_exchange_behind_inner_steps(run2):
    stats = run2[0]["replicas"]["streaming"]["stats"]
    assert stats["hidden"] is not None and stats["hidden"] > 0.0
    assert run2[0]["replicas"]["diloco"]["stats"]["bytes_sent"] > 0


def test_compressed_pseudo_gradients_send_fewer_bytes(run2):
    raw = run2[0]["replicas"]["diloco"]["stats"]
    four = run2[0]["replicas"]["diloco-minmax4"]["stats"]
    assert raw["outer_steps"] == four["outer_steps"]
    assert four["bytes_sent"] * 5 < raw["bytes_sent"], (raw, four)


def test_h1_with_plain_sgd_is_synchronous_sgd(run2):
    for result in run2:
        r = result["synchronous_sgd"]
        assert r["max_difference"] < 1e-5 * max(1.0, r["scale"]), r


def test_a_warmup_trains_synchronously_then_diloco_begins(run2):
    records = [r["warmup"] for r in run2]
    first = records[0]
    for step in range(5):  # every worker takes the same steps: AdamW on averaged gradients
        assert len({r["local"][step] for r in records}) == 1, f"step {step + 1}"
        assert first["outer_steps"][step] == 0
    assert first["global"][4] == first["local"][4]  # the global parameters start from them
    assert len({r["local"][5] for r in records}) == 2  # then each trains on its own data
    # The outer steps follow every H = 4 steps after the warm-up: at steps 9, 13, 17, ...
    assert first["outer_steps"][7] == 0 and first["outer_steps"][8] == 1
    assert first["outer_steps"][12] == 2
    for step in range(len(first["global"])):
        assert len({r["global"][step] for r in records}) == 1, f"global, step {step + 1}"
    for r in records:
        assert r["max_difference"] < 1e-5, r["max_difference"]
        assert r["stats"]["warmup_seconds"] > 0


def test_diloco_trains_close_to_synchronous_adamw(run2):
    for result in run2:
        losses = result["converge"]
        first = sum(losses["adamw"][:5]) / 5
        adamw = sum(losses["adamw"][-20:]) / 20
        assert adamw < 0.5 * first
        for name in ("diloco", "diloco-minmax4"):
            final = sum(losses[name + "-global"]) / 20
            assert final < 1.5 * adamw + 0.1, (name, final, adamw)


def test_a_resumed_run_continues_bit_for_bit_with_an_exchange_in_flight(run2):
    for result in run2:
        r = result["resume"]
        assert r["in_flight"], "the save must happen with an exchange in flight"
        assert r["resumed"] == r["continued"]
        assert r["rewound"] == r["continued"]  # loaded into a DiLoCo that trained on
        assert r["resumed_global"] == r["continued_global"]
        assert r["control"] != r["continued"]  # without the DiLoCo state the run differs
        assert "was saved with sync_every=6" in r["other"]
    assert len({result["resume"]["continued_global"] for result in run2}) == 1


def test_workers_with_different_settings_fail_naming_the_setting(run2):
    for result in run2:
        m = result["mismatch"]
        assert m["type"] == "MismatchError"
        assert "sync_every" in m["error"], m


def test_a_nonfinite_pseudo_gradient_fails_every_worker_naming_it(run2):
    for result in run2:
        r = result["nonfinite"]
        assert r["type"] == "InvalidArgument", r
        assert "worker(s) 1" in r["error"] and "inner step 4" in r["error"], r
        assert r["global_finite"]


def test_a_nonfinite_gradient_in_the_warmup_fails_every_worker_naming_it(run2):
    for result in run2:
        r = result["nonfinite_warmup"]
        assert r["type"] == "InvalidArgument", r
        assert "warm-up step 3" in r["error"] and "worker(s) 1" in r["error"], r
        assert r["unchanged"], "no inner step may be taken"


def test_a_dead_worker_is_a_bounded_error(tmp_path):
    procs = start_ranks(2, ["dead"], tmp_path, worker=WORKER)
    for p in procs:
        p.wait(timeout=90)
    result = read_results(tmp_path, 2)[0]
    assert result is not None and result["error"] is not None, [p.stdout.read() for p in procs]
    assert result["seconds"] < 30, result
    assert "rank" in result["error"]


def _model():
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))


@pytest.mark.parametrize("knobs, message", [
    (dict(sync_every=0), "sync_every (H) must be an integer >= 1"),
    (dict(sync_every=4, delay=4), "delay (tau) must be an integer in [0, sync_every=4)"),
    (dict(sync_every=4, mixing=1.0), "mixing (alpha) must be a number in [0, 1)"),
    (dict(sync_every=2, fragments=3), "3 fragments need sync_every >= 3"),
    (dict(sync_every=4, fragments=9), "fragments must be between 1 and the 4"),
    (dict(sync_every=4, fragments=[["0.weight", "0.bias"], ["1.weight"]]),
     "the fragments do not cover parameter '1.bias'"),
    (dict(sync_every=4, fragments=[["0.weight", "0.bias", "1.weight"], ["1.weight", "1.bias"]]),
     "parameter '1.weight' is in fragments 0 and 1"),
    (dict(sync_every=4, fragments=[["0.weight", "nope"]]), "names 'nope'"),
    (dict(sync_every=4, codec="nosuchcodec"), "nosuchcodec"),
    (dict(sync_every=4, warmup=-1), "warmup must be an integer >= 0"),
    (dict(sync_every=4, warmup_codec="nosuchcodec"), "warmup_codec 'nosuchcodec'"),
])
def test_bad_settings_are_refused_by_name_before_connecting(knobs, message):
    model = _model()
    with pytest.raises(terse.Error, match=None) as info:
        terse.diloco.DiLoCo(model, torch.optim.AdamW(model.parameters()), **knobs)
    assert message in str(info.value)


def test_parameters_the_inner_optimizer_does_not_update_are_refused():
    model = _model()
    with pytest.raises(terse.InvalidArgument, match="does not update parameter '1.weight'"):
        terse.diloco.DiLoCo(model, torch.optim.AdamW(model[0].parameters()), sync_every=4)


def test_an_fp16_model_is_refused():
    model = _model().half()
    with pytest.raises(TypeError, match="keeps fp32 parameters"):
        terse.diloco.DiLoCo(model, torch.optim.AdamW(model.parameters()), sync_every=4)


def test_nesterov_without_momentum_is_plain_sgd():
    # Momentum 0 (an outer step of lr 1 is then the plain average of the workers' parameters).
    param = torch.nn.Parameter(torch.ones(3))
    outer = terse.diloco.nesterov(1.0, 0.0)([param])
    param.grad = torch.full((3,), 0.25)
    outer.step()
    assert outer.param_groups[0]["nesterov"] is False
    assert torch.equal(param.detach(), torch.full((3,), 0.75))
