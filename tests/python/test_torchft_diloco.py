"""The harness's torchft baseline (terse_harness.torchft_diloco): torchft's DiLoCo on 4 CPU ranks
over Gloo, checked by bench/torchft_diloco_check.py. Skipped without the torchft package."""

import importlib.util
import subprocess

import pytest

from conftest import PYTHON, REPO, free_port

# Collected and skipped (not a module-level skip, which collects nothing: pytest's status 5).
pytestmark = pytest.mark.skipif(importlib.util.find_spec("torchft") is None,
                                reason="torchft is not installed for this interpreter")

CHECK = REPO / "bench" / "torchft_diloco_check.py"


def _check(args):
    cmd = [PYTHON, "-m", "torch.distributed.run", "--nproc_per_node", "4",
           "--master_port", str(free_port()), str(CHECK), *args]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=120)
    assert proc.returncode == 0 and proc.stdout.rstrip().endswith("OK"), proc.stdout


def test_diloco_keeps_replicas_bit_identical_and_matches_a_reference_outer_step():
    _check(["--sync-every", "5", "--steps", "20"])


def test_streaming_diloco_with_fragments_and_delay_keeps_global_parameters_identical():
    _check(["--sync-every", "6", "--steps", "24", "--fragments", "3", "--delay", "1"])
