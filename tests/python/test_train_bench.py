"""Smoke test of the training benchmark's driver (bench/train.py): a tiny configuration (2 ranks
over loopback, a few steps of the MLP on part of Fashion-MNIST) with DDP's allreduce and with
the terse hook, then the report. It checks that the driver still runs end to end and writes
what the full benchmark's report reads, not any figure."""

import json
import subprocess

import pytest

from conftest import PYTHON, REPO

DRIVER = str(REPO / "bench" / "train.py")
METHODS = ["ddp", "terse-powersgd-r4"]


def driver(*args: str, timeout: float = 300) -> str:
    proc = subprocess.run([PYTHON, DRIVER, *args], stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=timeout)
    assert proc.returncode == 0, f"bench/train.py {' '.join(args)} failed:\n{proc.stdout}"
    return proc.stdout


def test_driver_runs_a_tiny_configuration_and_reports(tmp_path):
    results = tmp_path / "results"
    run = ["run", "--link", "loopback", "--ranks", "2", "--models", "mlp", "--methods",
           ",".join(METHODS), "--steps", "6", "--warmup", "2", "--samples", "2048",
           "--evals-per-epoch", "2", "--results", str(results)]
    driver(*run)
    # The synchronization floor: ranks in step, gradients their own (replicas differ); and DGC,
    # whose momentum correction needs the optimizer without momentum of its own.
    floor = ["run", "--link", "loopback", "--ranks", "2", "--models", "mlp", "--methods",
             "sync-only,terse-dgc,terse-accordion-powersgd,terse-topk-warmup", "--steps", "6",
             "--warmup", "2", "--samples", "2048", "--results", str(results)]
    driver(*floor)
    r = json.loads((results / "loopback" / "mlp" / "sync-only.json").read_text())
    assert r["steps"] == 6 and r["samples_per_second"] > 0
    assert not r["replicas_identical"]  # each rank stepped with its own gradient
    r = json.loads((results / "loopback" / "mlp" / "terse-dgc.json").read_text())
    assert r["momentum"] == 0.0 and r["label"] == "terse dgc (SGD momentum 0)", r["label"]
    assert r["replicas_identical"], r["digests"]
    # Codec schedules: 16 steps an epoch make windows of 4 steps, so 6 steps end one window.
    for name, what in (("terse-accordion-powersgd", "Accordion"),
                       ("terse-topk-warmup", "SparseWarmup")):
        r = json.loads((results / "loopback" / "mlp" / f"{name}.json").read_text())
        assert r["replicas_identical"], r["digests"]
        assert r["schedule"]["describe"].startswith(what) and "window=4 steps" in \
            r["schedule"]["describe"], r["schedule"]
        assert r["schedule"]["windows"] == 1, r["schedule"]
    for name in METHODS:
        r = json.loads((results / "loopback" / "mlp" / f"{name}.json").read_text())
        assert r["name"] == name and r["ranks"] == 2 and r["steps"] == 6
        assert r["timed_steps"] == 4 and r["samples_per_second"] > 0
        assert r["replicas_identical"], r["digests"]
        assert 0.0 < r["test_accuracy"] <= 1.0
        # 2048 images are 16 steps of 2 x 64: accuracy at steps 8 and 16 of the epoch would
        # come after these 6 steps, so the one point of the curve is the final evaluation.
        assert [c["step"] for c in r["curve"]] == [6]
        assert r["wire_bytes_per_step"] is None  # loopback: no per-rank interface to count
        assert (r["payload_bytes_per_step"] is None) == (name == "ddp")
        assert (tmp_path / "results" / "loopback" / "mlp" / f"{name}.log").exists()

    # Resumable: a configuration with a JSON is not run again.
    assert driver(*run).count("done before, skipped") == len(METHODS)

    page = tmp_path / "page.md"
    page.write_text("intro\n<!-- training-report:begin -->\nold\n<!-- training-report:end -->\n"
                    "outro\n")
    out = driver("report", "--results", str(results), "--update", str(page), "--plots",
                 str(tmp_path / "plots"))
    assert "terse PowerSGD r4" in out and "DDP fp32" in out
    text = page.read_text()
    assert text.startswith("intro\n") and text.endswith("outro\n") and "old" not in text
    assert "| terse PowerSGD r4 | " in text
    assert "| sync only (1 float per bucket) | " in text and "n/a (floor)" in text
    assert (tmp_path / "plots" / "training-throughput.png").stat().st_size > 0
    assert (tmp_path / "plots" / "training-accuracy-mlp.png").stat().st_size > 0


def test_driver_trains_the_language_model(tmp_path):
    """The byte-level GPT on the fortunes (AdamW by default): a few steps of DDP and of the
    terse hook, validation loss reported and falling, replicas identical; then its report."""
    results = tmp_path / "results"
    driver("run", "--link", "loopback", "--ranks", "2", "--model", "gpt", "--methods",
           "ddp,terse-fp16,onebit-adam", "--steps", "8", "--warmup", "2", "--evals-per-epoch",
           "2", "--results", str(results))
    for name in ("ddp", "terse-fp16", "onebit-adam"):
        r = json.loads((results / "loopback" / "gpt" / f"{name}.json").read_text())
        assert r["task"] == "lm" and r["lr"] == 1e-3
        assert r["optimizer"] == ("onebit-adam" if name == "onebit-adam" else "adamw")
        assert r["steps"] == 8 and r["timed_steps"] == 6 and r["replicas_identical"]
        assert r["test_accuracy"] is None and r["target_loss"] > 0
        losses = [c["val_loss"] for c in r["curve"]]
        assert [c["step"] for c in r["curve"]] == [4, 8]
        # From ln 256 = 5.55 nats per byte at the start, down within a few AdamW steps.
        assert losses[-1] == r["val_loss"] and losses[-1] < losses[0] < 5.55, losses
        assert r["time_to_loss"] is None  # far from the target after 8 steps
    # 1-bit Adam freezes after 3 of the 8 steps (40 %): steps 5-8, between the two
    # evaluations, send the momentum in about 1 bit per element twice (to the shard owners and
    # back), not DDP's 32.
    onebit = json.loads((results / "loopback" / "gpt" / "onebit-adam.json").read_text())
    sent = [c["payload_bytes"] for c in onebit["curve"]]
    assert 0 < (sent[1] - sent[0]) / 4 < onebit["gradient_bytes"] / 8, sent
    text = driver("report", "--results", str(results), "--plots", str(tmp_path / "plots"))
    assert "| DDP fp32 | " in text and "| terse fp16 | " in text and "time to target s" in text
    assert (tmp_path / "plots" / "training-loss-gpt.png").stat().st_size > 0


def test_run_config_checks_the_optimizer():
    from terse_harness.training import RunConfig

    assert RunConfig(model="mlp").optimizer_name() == "sgd"
    assert RunConfig(model="gpt", steps=1).optimizer_name() == "adamw"
    assert RunConfig(model="mlp", optimizer="adamw").optimizer_name() == "adamw"
    with pytest.raises(ValueError, match="unknown optimizer 'adam'"):
        RunConfig(model="mlp", optimizer="adam")
    with pytest.raises(ValueError, match="give steps > 0"):
        RunConfig(model="gpt")
    with pytest.raises(ValueError, match="lr_drops"):
        RunConfig(model="gpt", steps=1, lr_drops=(1,))
    with pytest.raises(ValueError, match="communicates itself: use it with method ddp"):
        RunConfig(model="gpt", steps=1, method="terse", optimizer="zeroone-adam")
