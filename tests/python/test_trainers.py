"""terse's DDP hook inside the trainers users run, each with the real package in 2 processes on
CPU (Gloo): PyTorch Lightning (terse.lightning), Hugging Face Accelerate (the hook registered
on what accelerator.prepare returns) and the Hugging Face Trainer (terse.hf). Each run trains
the MLP of trainers_worker.py on Fashion-MNIST with the hook and, as the control, without it."""

import importlib.util
import os
import pickle
import subprocess
import sys

import pytest

from conftest import HERE, PYTHON, free_port, read_results

WORKER = HERE / "trainers_worker.py"
ACCELERATE_STEPS = 6  # optimizer steps of trainers_worker.accelerate (2 micro-batches each)


def _missing(*modules):
    absent = [m for m in modules if importlib.util.find_spec(m) is None]
    return (f"{', '.join(absent)} not installed for {sys.executable} (scripts/requirements.txt "
            "installs them into the project's venv)") if absent else None


def _needs(*modules):
    reason = _missing(*modules)
    return pytest.mark.skipif(reason is not None, reason=reason or "")


def _run(cmd, out, timeout=150):
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
               HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               XDG_CACHE_HOME=str(out / "cache"), HF_HOME=str(out / "hf-home"))
    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        env.pop(var, None)
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=timeout, env=env, cwd=str(out))
    assert proc.returncode == 0, f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout}"
    results = read_results(out, 2)
    assert all(results), f"a rank wrote no result:\n{proc.stdout}"
    return results


def _torchrun(scenario, out):
    return _run([PYTHON, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                 "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
                 str(WORKER), scenario, "--out", str(out)], out)


def _check_terse_run(results, steps):
    """Replicas identical, the hook reduced every step and sent compressed bytes, loss finite;
    and the control (the same training without the hook) ended elsewhere."""
    assert [r["world"] for r in results] == [2, 2]
    terse_runs = [r["terse"] for r in results]
    assert len({t["digest"] for t in terse_runs}) == 1, "replicas differ after training with terse"
    for t in terse_runs:
        assert t["connected"] and t["steps"] == steps
        # Two ranks: DDP's fp32 ring would send each rank's full gradient once per step.
        assert 0 < t["bytes_sent"] < 0.25 * steps * t["fp32_bytes"]
        assert t["losses"] and all(0 < loss < 10 for loss in t["losses"])
    controls = [r["control"] for r in results]
    assert len({c["digest"] for c in controls}) == 1, "replicas differ after plain DDP"
    # PowerSGD changes what training computes: had the hook not run, both would be equal.
    assert controls[0]["digest"] != terse_runs[0]["digest"]
    return terse_runs, controls


@_needs("lightning")
def test_lightning_callback(tmp_path):
    # Lightning's launcher starts the second rank itself (it runs this script again).
    results = _run([PYTHON, str(WORKER), "lightning", "--out", str(tmp_path)], tmp_path)
    _, controls = _check_terse_run(results, steps=6)
    # Lightning's own door, DDPStrategy(ddp_comm_state=..., ddp_comm_hook=...), registers the
    # hook on CUDA only: on CPU the lazy state was never called (docs/python.md says so).
    for c in controls:
        assert c["connected"] is False and c["bytes_sent"] == 0 and c["steps"] == 0


@_needs("accelerate")
def test_accelerate_prepared_model(tmp_path):
    # `accelerate launch --multi_gpu` starts its ranks through torchrun, on CPU too (`--cpu`
    # alone would start one process); the script's Accelerator(cpu=True) then runs MULTI_CPU.
    results = _run([PYTHON, "-m", "accelerate.commands.launch", "--multi_gpu",
                    "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
                    "--dynamo_backend", "no", "--main_process_port", str(free_port()),
                    str(WORKER), "accelerate", "--out", str(tmp_path)], tmp_path)
    assert {r["ddp"] for r in results} == {"MULTI_CPU"}
    # accelerator.accumulate() runs the first micro-batch of each step under no_sync(): the
    # hook reduces once per optimizer step.
    _check_terse_run(results, steps=ACCELERATE_STEPS)


@_needs("transformers", "accelerate")
def test_hf_trainer_register(tmp_path):
    results = _torchrun("hf", tmp_path)
    _check_terse_run(results, steps=6)


def test_adapters_import_without_the_trainers():
    # The adapters import their trainer when used, not with the module (torch 1.13 leg too).
    code = ("import sys, terse.lightning, terse.hf; "
            "bad = [m for m in ('lightning', 'pytorch_lightning', 'transformers', 'accelerate') "
            "if m in sys.modules]; assert not bad, bad")
    subprocess.run([PYTHON, "-c", code], check=True, timeout=60)


@pytest.mark.skipif(importlib.util.find_spec("transformers") is not None,
                    reason="transformers is installed")
def test_hf_without_transformers_says_what_is_missing():
    import terse.hf
    with pytest.raises(ImportError, match="pip install transformers"):
        terse.hf.register(object(), codec="fp16")


def test_lazy_state_validates_now_and_connects_later():
    import terse
    import terse.torch
    with pytest.raises(terse.SpecError, match="no-such-codec"):
        terse.torch.ddp_hook(None, lazy=True, codec="no-such-codec")
    state, _ = terse.torch.ddp_hook(None, lazy=True, codec="fp16")
    assert not state.connected and state.engine is None and state.bytes_sent == 0
    with pytest.raises(terse.InvalidArgument, match="state.connect"):
        state.state_dict()
    # Lightning's ddp_spawn pickles callbacks: an unconnected state travels.
    copy = pickle.loads(pickle.dumps(state))
    assert not copy.connected and copy.codec == "fp16"
    state.close()
