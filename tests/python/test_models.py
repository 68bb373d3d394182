"""The model zoo follows its one definition: every model of bench/terse_harness/models.json is
built by the harness with the listed shapes, in order, and `terse plan --model` sees the same
tensors (names and element counts) as the harness's sizes."""

import json
import subprocess

import pytest
import torch

from conftest import TERSE_CLI
from terse_harness import models, pipeline, training

MODELS = models.names()


@pytest.mark.parametrize("name", MODELS)
def test_torch_model_has_the_defined_shapes(name):
    torch.manual_seed(0)
    module = models.build(name)
    assert models.mismatch(name, module) == ""


def test_every_workload_trains_a_defined_model():
    assert set(training.MODELS) <= set(MODELS)
    assert {spec["network"] for spec in pipeline.MODELS.values()} <= set(MODELS)
    # The demo's MLP is the zoo's.
    from terse.demo import mlp

    assert models.parameter_shapes(mlp()) == models.parameter_shapes(models.build("mlp"))


@pytest.mark.parametrize("name", MODELS)
def test_terse_plan_reads_the_same_definition(name, tmp_path):
    out = tmp_path / "sizes.json"
    proc = subprocess.run([TERSE_CLI, "plan", "--model", name, "--ranks", "4", "--bandwidth",
                           "1gbit", "--write-sizes", str(out), "--sizes-only"],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.returncode == 0, proc.stdout
    assert json.loads(out.read_text()) == models.sizes(name)
