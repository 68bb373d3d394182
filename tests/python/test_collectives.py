"""Engine.reduce_scatter, all_gather and all_to_all from Python: numpy buffers and torch CPU
tensors borrowed zero-copy, two ranks as two threads of this process (the binding releases the
GIL while it waits)."""

import numpy as np
import pytest
import torch

import terse
from test_module import TIMEOUT, one_rank_engine, run_ranks


def two_ranks(tmp_path, body):
    store = terse.file_store(str(tmp_path))

    def rank(r: int):
        comm = terse.Communicator(r, 2, store, timeout=TIMEOUT)
        with terse.Engine(comm, terse.EngineOptions(threads=2)) as engine:
            out = body(r, engine)
            comm.barrier("end")
        return out

    return run_ranks(2, rank)


def test_reduce_scatter_gives_each_rank_its_shards_sum(tmp_path):
    rng = np.random.default_rng(1)
    inputs = [rng.standard_normal(2 * 5000).astype(np.float32) for _ in range(2)]

    def body(r, engine):
        raw = np.zeros(5000, np.float32)
        engine.reduce_scatter("g", inputs[r], raw).wait()
        lossy = torch.zeros(5000)
        engine.reduce_scatter("g8", torch.from_numpy(inputs[r]), lossy, codec="minmax8",
                              average=False).wait()
        return raw, lossy.numpy()

    results = two_ranks(tmp_path, body)
    total = inputs[0] + inputs[1]
    for r, (raw, lossy) in enumerate(results):
        shard = slice(r * 5000, (r + 1) * 5000)
        np.testing.assert_array_equal(raw, total[shard] / 2)  # the rank-order fp32 sum
        np.testing.assert_allclose(lossy, total[shard], atol=0.1)


def test_all_gather_is_identical_on_every_rank_with_a_lossy_codec(tmp_path):
    rng = np.random.default_rng(2)
    shards = [torch.from_numpy(rng.standard_normal(3000).astype(np.float32)) for _ in range(2)]

    def body(r, engine):
        out = torch.empty(6000)
        engine.all_gather("w", shards[r], out, codec="minmax8").wait()
        half = torch.empty(6000, dtype=torch.bfloat16)
        engine.all_gather("wb", shards[r].to(torch.bfloat16), half).wait()
        return out, half

    (o0, h0), (o1, h1) = two_ranks(tmp_path, body)
    assert torch.equal(o0, o1)
    assert torch.equal(h0, h1)
    assert torch.equal(h0, torch.cat(shards).to(torch.bfloat16))  # raw: the values themselves
    torch.testing.assert_close(o0, torch.cat(shards), atol=0.05, rtol=0)


def test_all_to_all_delivers_uneven_blocks(tmp_path):
    counts = [[3, 1000], [0, 17]]  # counts[i][j]: rank i sends rank j

    def body(r, engine):
        send = counts[r]
        recv = [counts[0][r], counts[1][r]]
        x = torch.arange(sum(send), dtype=torch.float32) + 10000 * r
        y = torch.full((sum(recv),), -1.0)
        engine.all_to_all("moe", x, send, y, recv).wait()
        return y

    y0, y1 = two_ranks(tmp_path, body)
    assert torch.equal(y0, torch.arange(3, dtype=torch.float32))  # rank 1 sends rank 0 nothing
    assert torch.equal(y1, torch.cat([torch.arange(3, 1003, dtype=torch.float32),
                                      torch.arange(17, dtype=torch.float32) + 10000]))


def test_bad_sizes_raise_at_once_naming_the_operation(tmp_path):
    with one_rank_engine(tmp_path) as engine:
        with pytest.raises(terse.InvalidArgument, match="reduce_scatter of tensor 'g'"):
            engine.reduce_scatter("g", torch.zeros(10), torch.zeros(9))
        with pytest.raises(terse.InvalidArgument, match="all_to_all of tensor 't'.*must sum"):
            engine.all_to_all("t", torch.zeros(10), [9], torch.zeros(10), [10])
        with pytest.raises(terse.SpecError):
            engine.all_gather("w", torch.zeros(10), torch.zeros(10), strategy="nonsense")
        assert "alltoall" in terse.strategies()


def test_allreduce_in_two_levels_over_hosts_is_identical_and_sends_less_across(tmp_path):
    """Four ranks as two hosts of two (EngineOptions.topology): the hierarchical allreduce gives
    every rank the same bytes, close to the flat average, and puts fewer bytes on the host links."""
    store = terse.file_store(str(tmp_path))
    rng = np.random.default_rng(3)
    inputs = [rng.standard_normal(1 << 20).astype(np.float32) for _ in range(4)]

    def rank(r: int):
        comm = terse.Communicator(r, 4, store, timeout=TIMEOUT)
        options = terse.EngineOptions(threads=2, topology="2,2")
        with terse.Engine(comm, options) as engine:
            assert engine.hosts == [[0, 1], [2, 3]]
            assert engine.reads_directly_inside_host  # one machine: the host's ranks read
            assert engine.options.intra_host == "auto"
            assert engine.plan(1 << 20).hierarchical  # hierarchy "auto" on two levels
            assert not engine.plan(1 << 20, hierarchy="flat").hierarchical
            out = {}
            for hierarchy in ("flat", "hosts"):
                for codec in ("none", "minmax8:ef=1"):
                    before = engine.bytes_sent_across_hosts
                    y = torch.from_numpy(inputs[r].copy())
                    engine.allreduce(f"g/{codec}/{hierarchy}", y, codec=codec,
                                     hierarchy=hierarchy).wait()
                    out[codec, hierarchy] = (y, engine.bytes_sent_across_hosts - before)
            comm.barrier("end")
        return out

    results = run_ranks(4, rank)
    mean = torch.from_numpy(sum(inputs) / 4)
    for key in results[0]:
        for r in range(1, 4):
            assert torch.equal(results[r][key][0], results[0][key][0]), (key, r)
    assert torch.allclose(results[0]["none", "hosts"][0], mean, atol=1e-6)
    assert torch.allclose(results[0]["minmax8:ef=1", "hosts"][0], mean, atol=0.05)

    def across(key):  # bytes on host 0's link: what its ranks sent to host 1
        return results[0][key][1] + results[1][key][1]

    assert across(("none", "hosts")) < 0.75 * across(("none", "flat"))
    assert across(("minmax8:ef=1", "hosts")) < 0.6 * across(("minmax8:ef=1", "flat"))


def test_reduce_scatter_and_all_gather_in_two_levels_send_less_across_hosts(tmp_path):
    """Two hosts of two: reduce_scatter and all_gather take two levels under hierarchy "auto"
    (and "hosts"); raw ones give the flat results up to fp32 rounding (the all-gather exactly),
    every rank's all-gather is bit-identical, and each host link carries half the bytes."""
    store = terse.file_store(str(tmp_path))
    rng = np.random.default_rng(5)
    shard = 1 << 18
    grads = [rng.standard_normal(4 * shard).astype(np.float32) for _ in range(4)]
    params = [rng.standard_normal(shard).astype(np.float32) for _ in range(4)]

    def rank(r: int):
        comm = terse.Communicator(r, 4, store, timeout=TIMEOUT)
        options = terse.EngineOptions(threads=2, topology="2,2")
        out = {}
        with terse.Engine(comm, options) as engine:
            for hierarchy in ("flat", "auto", "hosts"):
                for codec in ("none", "minmax8:ef=1"):
                    before = engine.bytes_sent_across_hosts
                    y = torch.empty(shard)
                    engine.reduce_scatter(f"rs/{codec}/{hierarchy}", torch.from_numpy(grads[r]),
                                          y, codec=codec, hierarchy=hierarchy).wait()
                    out["rs", codec, hierarchy] = (y, engine.bytes_sent_across_hosts - before)
                    before = engine.bytes_sent_across_hosts
                    g = torch.empty(4 * shard)
                    engine.all_gather(f"ag/{codec}/{hierarchy}", torch.from_numpy(params[r]), g,
                                      codec=codec, hierarchy=hierarchy).wait()
                    out["ag", codec, hierarchy] = (g, engine.bytes_sent_across_hosts - before)
            with pytest.raises(terse.SpecError, match="hierarchy"):
                engine.reduce_scatter("x", torch.ones(4), torch.ones(1), hierarchy="nonsense")
            comm.barrier("end")
        return out

    results = run_ranks(4, rank)
    mean = torch.from_numpy(sum(grads) / 4)
    gathered = torch.from_numpy(np.concatenate(params))
    for r in range(4):
        mine = mean[r * shard:(r + 1) * shard]
        for hierarchy in ("flat", "auto", "hosts"):
            assert torch.allclose(results[r]["rs", "none", hierarchy][0], mine, atol=1e-6)
            assert torch.allclose(results[r]["rs", "minmax8:ef=1", hierarchy][0], mine,
                                  atol=0.05)
            assert torch.equal(results[r]["ag", "none", hierarchy][0], gathered)
            assert torch.equal(results[r]["ag", "minmax8:ef=1", hierarchy][0],
                               results[0]["ag", "minmax8:ef=1", hierarchy][0])

    def across(*key):  # bytes on host 0's link: what its ranks sent to host 1
        return results[0][key][1] + results[1][key][1]

    for op in ("rs", "ag"):
        for codec in ("none", "minmax8:ef=1"):
            assert across(op, codec, "auto") == across(op, codec, "hosts")
            assert across(op, codec, "hosts") < 0.55 * across(op, codec, "flat"), (op, codec)
