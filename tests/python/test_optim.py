"""terse.optim: 1-bit Adam and 0/1 Adam in real multi-process training (ranks started by
`terse run`, Gloo process group, Fashion-MNIST, with and without DDP)."""

import pytest
import torch

import terse
import terse.optim
from conftest import HERE, launch

WORKER = HERE / "optim_worker.py"
KINDS = ["onebit", "onebit-ddp", "zeroone", "zeroone-ddp", "onebit-deepspeed",
         "zeroone-deepspeed"]


@pytest.fixture(scope="module")
def run2(tmp_path_factory):
    return launch(2, ["all"], tmp_path_factory.mktemp("optim2"), worker=WORKER)


@pytest.fixture(scope="module")
def run4(tmp_path_factory):
    return launch(4, ["replicas"], tmp_path_factory.mktemp("optim4"), worker=WORKER)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("kind", KINDS)
def test_replicas_are_bit_identical_after_every_synchronizing_step(world, kind, run2, run4):
    results = run2 if world == 2 else run4
    records = [r["replicas"][kind] for r in results]
    steps = len(records[0]["digests"])
    assert records[0]["frozen"][-1], "the run must reach the compressed stage"
    for step in range(steps):
        synced = records[0]["synchronized"][step]
        assert all(r["synchronized"][step] == synced for r in records)
        digests = {r["digests"][step] for r in records}
        if synced:
            assert len(digests) == 1, f"{kind}: ranks differ after step {step + 1}"
    if kind.startswith("zeroone"):
        # 0/1 Adam's local steps: each rank's parameters differ until the next synchronization.
        local = [s for s in range(steps) if not records[0]["synchronized"][s]]
        assert local and all(len({r["digests"][s] for r in records}) == world for s in local)


@pytest.mark.parametrize("world", [2, 4])
def test_compressed_steps_send_at_least_15_times_fewer_bytes_than_fp32(world, run2, run4):
    results = run2 if world == 2 else run4
    for kind in ("onebit", "onebit-ddp", "onebit-deepspeed"):
        record = results[0]["replicas"][kind]
        warm = [b for b, f in zip(record["bytes"], record["frozen"]) if not f]
        # frozen is recorded after each step: the first frozen step was the last warm one.
        compressed = [b for b, f in zip(record["bytes"], record["frozen"]) if f][1:]
        fp32_ring = 2 * (world - 1) / world * 4 * record["parameters"]
        assert min(warm) >= 0.9 * fp32_ring  # warm-up: exact fp32 averages
        assert max(compressed) * 15 <= min(warm), (kind, warm, compressed)
    # 0/1 Adam's local steps send nothing.
    assert 0 in results[0]["replicas"]["zeroone"]["bytes"]


def test_onebit_adam_trains_as_well_as_adam_under_ddp(run2):
    for result in run2:
        losses = result["converge"]
        last = {k: sum(v[-20:]) / 20 for k, v in losses.items()}
        first = sum(losses["adam"][:5]) / 5
        assert last["adam"] < 0.4 * first
        for form in ("", "-deepspeed"):  # preconditioned (the default), and DeepSpeed's
            assert last["onebit" + form] < 1.2 * last["adam"] + 0.05, last
            assert last["zeroone" + form] < 1.5 * last["adam"] + 0.1, last


@pytest.mark.parametrize("kind", ["onebit", "zeroone"])
def test_a_resumed_run_continues_bit_for_bit(kind, run2):
    for result in run2:
        r = result["resume"][kind]
        assert r["resumed"] == r["continued"]
        # Control: without the saved error-feedback residuals the run differs.
        assert r["control"] != r["continued"]
        assert "was saved with" in r["other"]
    assert len({result["resume"][kind]["continued"] for result in run2}) == 1


@pytest.mark.parametrize("setting, name", [("lr", "lr (group 0)"),
                                           ("precondition", "precondition")])
def test_ranks_with_different_settings_fail_naming_the_setting(setting, name, run2):
    for result in run2:
        assert result["mismatch"][setting]["type"] == "MismatchError"
        assert f"setting '{name}' differs across ranks" in result["mismatch"][setting]["error"]


def _params():
    return torch.nn.Linear(4, 3).parameters()


@pytest.mark.parametrize("knobs, words", [
    (dict(lr=-1.0), "lr must be"),
    (dict(lr=float("nan")), "lr must be"),
    (dict(betas=(0.9, 1.0)), "betas must be"),
    (dict(betas=(-0.1, 0.9)), "betas must be"),
    (dict(eps=0.0), "eps must be"),
    (dict(weight_decay=-1e-4), "weight_decay must be"),
    (dict(freeze_step=-1), "freeze_step must be"),
    (dict(codec="bogus"), "unknown codec 'bogus'"),
    (dict(codec="auto"), "name a codec with error feedback"),
    (dict(threads=-1), "threads must be"),
    (dict(precondition=1), "precondition must be True or False"),
])
def test_bad_hyper_parameters_are_refused_by_name_before_connecting(knobs, words):
    with pytest.raises(terse.InvalidArgument, match=words.replace("(", r"\(")):
        terse.optim.OneBitAdam(_params(), **knobs)


@pytest.mark.parametrize("knob", ["var_freeze_step", "var_update_scaler", "local_step_scaler",
                                  "local_step_clipper"])
def test_bad_zero_one_schedules_are_refused_by_name(knob):
    with pytest.raises(terse.InvalidArgument, match=f"{knob} must be"):
        terse.optim.ZeroOneAdam(_params(), **{knob: -1})


def test_a_bad_group_lr_is_refused_naming_the_group():
    groups = [{"params": [torch.nn.Parameter(torch.zeros(3))]},
              {"params": [torch.nn.Parameter(torch.zeros(3))], "lr": -0.5}]
    with pytest.raises(terse.InvalidArgument, match=r"parameter group 1"):
        terse.optim.OneBitAdam(groups)


def test_non_fp32_parameters_are_refused_by_name():
    model = torch.nn.Linear(4, 3).to(torch.bfloat16)
    with pytest.raises(TypeError, match="parameter 'weight' is torch.bfloat16"):
        terse.optim.OneBitAdam(model.parameters(), model=model)
