"""terse.fsdp in real multi-process FSDP training on CPU (FSDP2's fully_shard with Gloo for
FSDP's own collectives, and FSDP1's FullyShardedDataParallel), ranks started by `terse run`."""

import pathlib

import pytest
import torch

from conftest import launch

try:
    from torch.distributed.fsdp import FSDPModule
    HAS_FSDP2_HOOKS = hasattr(FSDPModule, "set_custom_reduce_scatter")
except Exception:  # noqa: BLE001 - torch 1.13's fsdp package fails to import on Python 3.11
    HAS_FSDP2_HOOKS = False
pytestmark = pytest.mark.skipif(
    not HAS_FSDP2_HOOKS,
    reason=f"torch {torch.__version__} has no FSDP2 custom collectives (torch >= 2.6 has)")

WORKER = pathlib.Path(__file__).resolve().parent / "fsdp_worker.py"

# Largest parameter difference between terse's raw reduce-scatter and FSDP's own: both average
# the same fp32 gradients once per step, in different summation orders (last-bit differences,
# relative 2^-24), carried through 8 SGD steps.
SUMMATION_ORDER_TOLERANCE = 1e-6


def max_difference(a, b):
    return max(max(abs(x - y) for x, y in zip(a[n], b[n])) for n in a)


@pytest.fixture(scope="module")
def train(tmp_path_factory):
    return {world: launch(world, ["train", "default", "none", "minmax8:ef=1"],
                          tmp_path_factory.mktemp(f"train{world}"), worker=WORKER)
            for world in (2, 3)}


@pytest.fixture(scope="module")
def quantized_gather(tmp_path_factory):
    return launch(2, ["train", "default", "minmax8:ef=1", "--all-gather-codec", "minmax8"],
                  tmp_path_factory.mktemp("gather"), worker=WORKER)


@pytest.mark.parametrize("world", [2, 3])
def test_compressed_training_lowers_the_loss(world, train):
    for r in train[world]:
        losses = r["minmax8:ef=1"]["losses"]
        assert losses[-1] < 0.95 * losses[0], losses
        assert r["minmax8:ef=1"]["reduce_scatters"] > 0


@pytest.mark.parametrize("world", [2, 3])
def test_parameters_are_identical_across_ranks(world, train):
    for codec in ("none", "minmax8:ef=1"):
        assert len({r[codec]["digest"] for r in train[world]}) == 1, codec


@pytest.mark.parametrize("world", [2, 3])
def test_raw_codec_matches_default_fsdp(world, train):
    r = train[world][0]
    assert max_difference(r["none"]["params"], r["default"]["params"]) < SUMMATION_ORDER_TOLERANCE
    # Control: the lossy codec's parameters differ from FSDP's by more than that.
    assert max_difference(r["minmax8:ef=1"]["params"],
                          r["default"]["params"]) > SUMMATION_ORDER_TOLERANCE


def test_compressed_gradients_send_fewer_bytes_than_raw(train):
    r = train[2][0]
    assert r["minmax8:ef=1"]["bytes_sent"] < 0.5 * r["none"]["bytes_sent"]


def test_quantized_all_gather_gives_every_rank_the_same_weights(quantized_gather):
    gathered = [r["minmax8:ef=1"]["gathered"] for r in quantized_gather]
    assert gathered[0][0] == gathered[1][0]  # digest of the whole gathered weight
    assert quantized_gather[0]["minmax8:ef=1"]["all_gathers"] > 0
    # Quantized: close to FSDP's exact gather of the same shards, not equal to it.
    exact = quantized_gather[0]["default"]["gathered"][1]
    quantized = gathered[0][1]
    assert quantized != exact
    assert max(abs(x - y) for x, y in zip(quantized, exact)) < 0.02
    for r in quantized_gather:
        losses = r["minmax8:ef=1"]["losses"]
        assert losses[-1] < 0.95 * losses[0]
    # The full-precision shards (what the optimizer updates) agree across ranks too.
    assert len({r["minmax8:ef=1"]["digest"] for r in quantized_gather}) == 1


def test_auto_codec_plans_reduce_scatter_and_all_gather_alike_on_every_rank(tmp_path):
    results = launch(2, ["train", "auto", "--all-gather-codec", "auto",
                         "--auto-codecs", "minmax8,fp16"], tmp_path, worker=WORKER)
    assert len({r["auto"]["digest"] for r in results}) == 1
    for r in results:
        assert r["auto"]["reduce_scatters"] > 0 and r["auto"]["all_gathers"] > 0
        losses = r["auto"]["losses"]
        assert losses[-1] < 0.95 * losses[0], losses


def test_auto_all_gather_refuses_codecs_that_keep_state():
    import terse
    import terse.fsdp
    with pytest.raises(terse.InvalidArgument, match="onebit"):
        terse.fsdp.TerseFSDPState(codec="none", all_gather_codec="auto",
                                  auto_codecs=["minmax8", "onebit:ef=1"])


def test_restored_state_continues_identically(tmp_path):
    results = launch(2, ["checkpoint", "minmax8:ef=1"], tmp_path, worker=WORKER)
    for r in results:
        assert r["restored"] == r["straight"]
        # Control: error feedback matters, so dropping terse's state changes the result.
        assert r["without_state"] != r["straight"]


def test_bad_codec_name_fails_clearly_on_every_rank(tmp_path):
    results = launch(2, ["bad_codec", "nosuchcodec"], tmp_path, worker=WORKER)
    for r in results:
        assert r["error"] == "SpecError"
        assert "nosuchcodec" in r["message"]


def test_fsdp1_hook_trains_and_matches_default_with_the_raw_codec(tmp_path):
    results = launch(2, ["fsdp1", "default", "none", "minmax8:ef=1"], tmp_path, worker=WORKER)
    for codec in ("default", "none", "minmax8:ef=1"):
        assert len({r[codec]["digest"] for r in results}) == 1, codec
    r = results[0]
    assert max_difference(r["none"]["params"], r["default"]["params"]) < SUMMATION_ORDER_TOLERANCE
    assert r["minmax8:ef=1"]["reduce_scatters"] > 0
    losses = r["minmax8:ef=1"]["losses"]
    assert losses[-1] < 0.95 * losses[0]


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    return launch(4, ["hosts"], tmp_path_factory.mktemp("hosts"), worker=WORKER)


def test_two_levels_reach_fsdp_and_keep_the_ranks_identical(hosts):
    for label in ("default", "flat", "hosts", "hpz"):
        assert len({r[label]["digest"] for r in hosts}) == 1, label
        losses = hosts[0][label]["losses"]
        assert losses[-1] < 0.95 * losses[0], (label, losses)
    assert hosts[0]["hosts"]["hosts"] == [[0, 1], [2, 3]]
    # 8-bit both ways, in two levels or not, stays close to FSDP's exact training.
    for label in ("flat", "hosts", "hpz"):
        assert max_difference(hosts[0][label]["params"], hosts[0]["default"]["params"]) < 0.05


def test_two_levels_halve_the_bytes_on_the_host_links_and_hpz_cuts_the_backward_gathers(hosts):
    def across(label):  # what host 0's ranks sent to host 1
        return hosts[0][label]["across"] + hosts[1][label]["across"]

    assert across("hosts") < 0.6 * across("flat")
    assert across("hpz") < 0.8 * across("hosts")
    for r in hosts:
        assert r["hpz"]["hpz"] and not r["hosts"]["hpz"]
        assert r["hpz"]["subgroup_gathers"] > 0 and r["hosts"]["subgroup_gathers"] == 0


def test_ranks_per_host_reads_the_topology_the_engine_reads(monkeypatch):
    import terse.fsdp
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    for spec, want in (("2,2", 2), ("4x2", 2), ("3,2", None), ("flat", None), ("1,1", None),
                       ("auto", None), ("2x", None)):
        monkeypatch.setenv("TERSE_TOPOLOGY", spec)
        assert terse.fsdp.ranks_per_host() == want, spec
    monkeypatch.setenv("TERSE_TOPOLOGY", "auto")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert terse.fsdp.ranks_per_host() == 4  # auto: torchrun's count
    monkeypatch.delenv("TERSE_TOPOLOGY")
    assert terse.fsdp.ranks_per_host() == 4

