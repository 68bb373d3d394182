"""terse.torch.pipeline: a model split into stages, one real process each (started by `terse
run`), exchanging activations and gradients through terse.Channel over Gloo on loopback, on
Fashion-MNIST images. Also terse.Channel and terse.Codec on their own."""

import os
import subprocess

import numpy as np
import pytest
import torch

import terse
import conftest
from conftest import HERE, PYTHON, free_port, read_results

WORKER = HERE / "pipeline_worker.py"


def launch(n, args, out, timeout=240):
    return conftest.launch(n, args, out, timeout=timeout, worker=WORKER)


# ---- Codec and Channel on their own ------------------------------------------------------------

def test_codec_roundtrip_matches_encode_then_decode():
    x = torch.randn(10000)
    for spec in ("none", "fp16", "minmax8:bits=4", "topk:ratio=0.1"):
        codec = terse.Codec(spec)
        payload = codec.encode(x)
        assert len(payload) <= codec.max_encoded_bytes(x.numel())
        decoded = torch.empty_like(x)
        codec.decode(payload, decoded)
        y = torch.empty_like(x)
        assert codec.roundtrip(x, y) == len(payload)
        assert torch.equal(y, decoded), spec
    assert torch.equal(y, y) and not torch.equal(y, x)  # lossy: the test could fail
    with pytest.raises(terse.InvalidArgument):
        terse.Codec("onebit:ef=1")  # stateful: needs a per-tensor state a single call lacks
    with pytest.raises(terse.DecodeError):
        terse.Codec("fp16").decode(terse.Codec("minmax8").encode(x), torch.empty_like(x))


def test_channel_between_threads_sends_and_fails_clearly(tmp_path):
    import threading

    store = terse.file_store(str(tmp_path / "store"))
    comms = [None, None]

    def connect(r):
        comms[r] = terse.Communicator(r, 2, store, timeout=5)

    threads = [threading.Thread(target=connect, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    a, b = terse.Channel(comms[0]), terse.Channel(comms[1])
    x = torch.randn(1000)
    got = torch.zeros(1000)
    h = b.recv(0, "act", got, "fp16")
    a.send(1, "act", x, "fp16").wait()
    h.wait()
    assert torch.allclose(got, x, rtol=1e-3, atol=1e-4) and not torch.equal(got, x)
    # A receiver expecting another codec gets a MismatchError naming the tensor and the peer.
    h = b.recv(0, "act", got, "minmax8")
    a.send(1, "act", x, "fp16").wait()
    with pytest.raises(terse.MismatchError, match=r"rank 1.*'act'.*peer 0"):
        h.wait()
    # NaN fails the sender at once and the receiver too, instead of a hang.
    h = b.recv(0, "act", got)
    bad = x.clone()
    bad[7] = float("nan")
    with pytest.raises(terse.InvalidArgument):
        a.send(1, "act", bad).wait()
    with pytest.raises(terse.InvalidArgument, match="element 7"):
        h.wait()
    assert got.numel() == 1000
    a.close(), b.close()


# ---- the pipeline ----------------------------------------------------------------------------

def reference(tmp_path, steps, micro_batches, schedule):
    """The same training in one process without a pipeline (pipeline_worker.reference)."""
    out = tmp_path / f"reference-{micro_batches}-{schedule}"
    r = launch(1, ["reference", "--steps", str(steps), "--micro-batches", str(micro_batches),
                   "--schedule", schedule], out)[0]
    return {name: torch.tensor(v) for name, v in r["parameters"].items()}


def stage_parameters(results, compressor):
    """{module-level name: tensor} gathered from every stage's results."""
    params = {}
    for r in results:
        for name, values in r[compressor]["parameters"].items():
            stage, layer, kind = name.split(".")
            first = {0: 0, 1: 2, 2: 4, 3: 6}[int(stage[len("stage"):])]
            params[f"{first + int(layer)}.{kind}"] = torch.tensor(values)  # flat, as reference
    return params


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_lossless_pipeline_equals_single_process_training(schedule, tmp_path):
    steps, m = 4, 4
    results = launch(4, ["train", "none", "--steps", str(steps), "--micro-batches", str(m),
                         "--schedule", schedule, "--dump"], tmp_path)
    got = stage_parameters(results, "none")
    same_order = reference(tmp_path, steps, m, schedule)
    assert set(got) == set(same_order)
    for name, p in same_order.items():
        # The same micro-batches accumulated in the same order: the same bits.
        assert torch.equal(got[name], p), name
    # Against the other accumulation order (and against one full batch) the parameters differ
    # only by float summation order: tiny, but not zero, which shows the order matters.
    other = reference(tmp_path, steps, m, "1f1b" if schedule == "gpipe" else "gpipe")
    full = reference(tmp_path, steps, 1, schedule)
    diffs = [max(float((got[n] - p).abs().max()) for n, p in ref.items())
             for ref in (other, full)]
    assert max(diffs) < 1e-5, diffs
    assert max(diffs) > 0, diffs


def test_compressed_pipelines_learn_and_send_less(tmp_path):
    # (The autoencoder needs its warm-up: see the next test.)
    compressors = ["none", "fp16", "minmax8:bits=4", "topk:ratio=0.25", "delta:minmax8:bits=2"]
    results = launch(4, ["train", *compressors, "--steps", "30", "--samples", "128",
                         "--backward", "minmax8:bits=8", "--width", "128"], tmp_path,
                     timeout=120)
    last = results[3]
    raw_bytes = results[0]["none"]["bytes_sent"]
    for c in compressors:
        losses = last[c]["losses"]
        assert np.mean(losses[-5:]) < losses[0] - 0.5, (c, losses)
        assert last[c]["accuracy"] > 0.6, (c, last[c]["accuracy"])
        if c != "none":
            assert results[0][c]["bytes_sent"] < 0.6 * raw_bytes, c
    # Delta: both sides of every boundary hold the same cache, bit for bit.
    for s in range(3):
        assert results[s]["delta:minmax8:bits=2"]["caches"]["out"] == \
            results[s + 1]["delta:minmax8:bits=2"]["caches"]["in"]


def test_autoencoder_after_warmup_learns_like_fp32(tmp_path):
    # Warm-up steps send fp32; then each boundary's autoencoder starts from the principal
    # components of the warm-up's activations and trains with the model.
    results = launch(4, ["train", "none", "ae:ratio=0.25", "--steps", "30", "--warmup", "5",
                         "--samples", "128", "--backward", "none", "--width", "128"], tmp_path)
    none, ae = results[3]["none"], results[3]["ae:ratio=0.25"]
    assert ae["losses"][:5] == none["losses"][:5]  # the warm-up is exact
    assert np.mean(ae["losses"][-5:]) < ae["losses"][0] - 0.5, ae["losses"]
    assert ae["accuracy"] > 0.6, (ae["accuracy"], none["accuracy"])
    # After the warm-up the code (a quarter of the activation) crosses the links both ways.
    assert results[0]["ae:ratio=0.25"]["bytes_sent"] < 0.5 * results[0]["none"]["bytes_sent"]
    assert results[1]["ae:ratio=0.25"]["profile"]["compressors"][0][0] == "ae:ratio=0.25"


def test_first_boundaries_can_stay_uncompressed(tmp_path):
    results = launch(4, ["train", "minmax8:bits=2", "--steps", "3", "--uncompressed", "2"],
                     tmp_path)
    compressors = results[0]["minmax8:bits=2"]["profile"]["compressors"]
    assert compressors == [["none", "none"], ["none", "none"],
                           ["minmax8:bits=2", "minmax8:bits=2"]]


def test_data_parallel_replicas_of_each_stage_stay_equal(tmp_path):
    # 2 stages x 2 replicas: replicas see different samples and average their gradients (and
    # their autoencoders' PCA statistics) with terse's engine, so they stay bit-identical.
    results = launch(4, ["train", "ae:ratio=0.25", "--replicas", "2", "--steps", "12",
                         "--warmup", "3", "--backward", "fp16", "--width", "128",
                         "--samples", "128"], tmp_path)
    runs = [r["ae:ratio=0.25"] for r in results]
    assert [(r["stage"], r["replica"]) for r in runs] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert runs[0]["parameters"] == runs[1]["parameters"]
    assert runs[2]["parameters"] == runs[3]["parameters"]
    assert runs[2]["losses"] != runs[3]["losses"]  # different samples: really two replicas
    assert np.mean(runs[2]["losses"][-3:]) < runs[2]["losses"][0] - 0.15, runs[2]["losses"]


@pytest.mark.parametrize("how", ["kill", "stall"])
def test_a_dead_stage_fails_the_others_with_a_terse_error(how, tmp_path):
    # kill: the victim's connections close and its neighbours fail at once (TransportError),
    # which fails their communicators and so the stages beyond them. stall: SIGSTOP keeps the
    # connections open; the neighbours fail at TERSE_TIMEOUT (TimeoutError).
    timeout = 3.0
    port = free_port()
    procs = []
    for r in range(4):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(r),
                   WORLD_SIZE="4", TERSE_TIMEOUT=str(timeout))
        procs.append(subprocess.Popen(
            [PYTHON, str(WORKER), "dead", "--victim", "2", "--at-step", "3", "--how", how,
             "--out", str(tmp_path)], env=env, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True))
    outputs = {}
    try:
        for rank in (0, 1, 3):
            try:
                outputs[rank] = procs[rank].communicate(timeout=60)[0]
            except subprocess.TimeoutExpired:
                pytest.fail(f"rank {rank} hung after stage 2 died")
    finally:
        procs[2].kill()
        outputs[2] = procs[2].communicate()[0]
    results = read_results(tmp_path, 4)
    for rank in (0, 1, 3):
        r = results[rank]
        assert r is not None and r["failed"], outputs[rank]
        assert procs[rank].returncode == 3, outputs[rank]
        assert r["error_type"] in ("TransportError", "TimeoutError"), r
        assert f"rank {rank}" in r["error"] and "peer" in r["error"], r
        assert "pipeline/" in r["error"] or "peer" in r["error"], r
        assert r["seconds_to_fail"] < timeout + 5, r
    # The neighbours of the dead stage name the tensor they were exchanging with it.
    for rank in (1, 3):
        assert "'pipeline/" in results[rank]["error"], results[rank]
