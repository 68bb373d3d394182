"""terse.moe: the mixture-of-experts layer over real processes (tests/python/moe_worker.py)."""

import pathlib

import pytest

from conftest import HERE, launch

WORKER = HERE / "moe_worker.py"


@pytest.mark.parametrize("ranks", [2, 3])
def test_moe_layer_matches_a_reference_computed_alone(tmp_path: pathlib.Path, ranks: int) -> None:
    results = launch(ranks, ["check", "fp16", "minmax8"], tmp_path, worker=WORKER)
    for rank, r in enumerate(results):
        # The exact exchange: the layer computes what one process holding every expert does.
        assert r["torch"]["output"] < 1e-5, (rank, r)
        assert r["torch"]["input_grad"] < 1e-5, (rank, r)
        # Lossy exchanges stay near their codec's error (relative, in norm). fp16 rounds each
        # value to 2^-11 of itself. minmax8 rounds to half a step of 1/255 of its chunk's range:
        # a rank's block is one chunk here, and the gradients' blocks are mostly empty capacity
        # slots and a few large values, so their small values lose most (a broken exchange
        # gives errors of order 1).
        assert r["fp16"]["output"] < 2e-3, (rank, r)
        assert r["fp16"]["input_grad"] < 2e-3, (rank, r)
        assert r["minmax8"]["output"] < 2e-2, (rank, r)
        assert r["minmax8"]["input_grad"] < 0.15, (rank, r)
        assert r["fp16"]["output"] > 0, "fp16 changed nothing: was the exchange lossy at all?"


def test_an_unknown_codec_fails_on_every_rank(tmp_path: pathlib.Path) -> None:
    results = launch(2, ["badcodec"], tmp_path, worker=WORKER)
    for r in results:
        assert r["error"] is not None and "nonesuch" in r["error"], r
