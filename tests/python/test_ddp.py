"""The terse DDP hook in real multi-process DistributedDataParallel training on CPU (Gloo process
group, Fashion-MNIST images, Debian's torch), ranks started by `terse run`, by plain subprocesses
with torchrun's environment, and by torch.multiprocessing.spawn."""

import signal
import subprocess

import pytest
import torch
import torch.multiprocessing as mp

import terse
from conftest import launch, read_results, start_ranks
import ddp_worker

# Codecs every DDP test trains with. Top-k keeps 10%: at 1% it needs more than these 10 steps
# to move the loss (error feedback releases what it withheld over many steps). "auto": the
# planner calibrates when the hook is created and chooses per parameter.
CODECS = ["none", "fp16", "onebit:ef=1", "powersgd", "qsgd", "topk:ratio=0.1,ef=1", "auto"]
STEPS = 10
PARAMETERS = ["0.weight", "0.bias", "2.weight", "2.bias", "4.weight", "4.bias"]

# Largest parameter difference allowed between codec "none" and DDP's own allreduce on 4
# ranks. Both average the same fp32 gradients exactly once per step, but Gloo's ring and terse's
# ring add the 4 contributions of an element in different orders, so an average can differ in
# its last bit (relative 2^-24, about 6e-8). Ten SGD steps with momentum 0.9 carry such
# differences forward and the network feeds them back through later gradients; observed
# differences are about 2e-8 for weights of magnitude up to about 0.1. 1e-6 leaves a wide
# margin yet is 10 times smaller than what fp16 (11-bit mantissa) rounding of the same gradients
# produces, which test_none_matches_ddp_up_to_summation_order checks as its control.
SUMMATION_ORDER_TOLERANCE = 1e-6


@pytest.fixture(scope="module")
def train2(tmp_path_factory):
    return launch(2, ["train", *CODECS, "--steps", str(STEPS)],
                  tmp_path_factory.mktemp("train2"))


@pytest.fixture(scope="module")
def train4(tmp_path_factory):
    return launch(4, ["train", "none", "fp16", "onebit:ef=1", "powersgd", "--steps", str(STEPS),
                      "--subgroups"], tmp_path_factory.mktemp("train4"))


@pytest.mark.parametrize("world", [2, 4])
def test_replicas_are_bit_identical_for_every_codec(world, train2, train4):
    results = train2 if world == 2 else train4
    codecs = [k for k, v in results[0].items() if isinstance(v, dict) and k != "subgroup"]
    assert len(codecs) >= 5
    for codec in codecs:
        digests = {r[codec]["digest"] for r in results}
        assert len(digests) == 1, f"{codec}: ranks disagree after training: {digests}"


def test_process_groups_get_their_own_terse_communicators(train4):
    sub = [r["subgroup"] for r in train4]
    assert [(s["rank"], s["size"]) for s in sub] == [(0, 2), (1, 2), (0, 2), (1, 2)]
    assert sub[0]["digest"] == sub[1]["digest"] and sub[2]["digest"] == sub[3]["digest"]
    assert sub[0]["digest"] != sub[2]["digest"]  # different batches: really separate jobs


def test_none_equals_ddp_exactly_on_two_ranks(train2):
    # With two ranks each average is (a + b) / 2 in either implementation: no order to differ.
    for r in train2:
        assert r["none"]["digest"] == r["ddp"]["digest"]
        assert r["none"]["max_abs_diff_from_ddp"] == 0.0


def test_none_matches_ddp_up_to_summation_order(train4):
    for r in train4:
        assert r["none"]["max_abs_diff_from_ddp"] <= SUMMATION_ORDER_TOLERANCE
        # Control: a real numerical change of the gradients exceeds the tolerance.
        assert r["fp16"]["max_abs_diff_from_ddp"] > 10 * SUMMATION_ORDER_TOLERANCE
        assert r["onebit:ef=1"]["max_abs_diff_from_ddp"] > 1000 * SUMMATION_ORDER_TOLERANCE


def test_compressed_training_learns_and_sends_less(train2):
    r = train2[0]
    raw = r["none"]["bytes_sent"]
    assert raw > 0
    for codec in CODECS:
        losses = r[codec]["losses"]
        assert sum(losses[-3:]) / 3 < losses[0] - 0.2, f"{codec} did not learn: {losses}"
    assert r["fp16"]["bytes_sent"] < 0.55 * raw
    assert r["onebit:ef=1"]["bytes_sent"] < 0.1 * raw
    assert r["powersgd"]["bytes_sent"] < 0.1 * raw


def test_small_tensors_travel_raw_and_weights_compressed(train2):
    plan = {name: (codec, strategy)
            for name, _, codec, strategy in train2[0]["onebit:ef=1"]["plan"]}
    assert plan["0.weight"][0].startswith("onebit") and plan["2.weight"][0].startswith("onebit")
    for small in ("0.bias", "2.bias", "4.weight", "4.bias"):
        assert plan[small] == ("none", "raw"), small


STATEFUL = ["onebit:ef=1", "powersgd", "qsgd"]


def test_resume_from_checkpoint_is_bit_identical(tmp_path):
    # Three ranks: with two, sums do not depend on their order, which would hide a resumed run
    # that fuses small tensors differently from the run it continues.
    codecs = STATEFUL + ["fp16", "none"]
    args = ["--steps", "4", "--checkpoint", str(tmp_path / "checkpoints")]
    (tmp_path / "checkpoints").mkdir()
    saved = launch(3, ["resume", "save", *codecs, *args], tmp_path / "save")
    loaded = launch(3, ["resume", "load", *codecs, *args], tmp_path / "load")
    for s, l in zip(saved, loaded):
        for codec in codecs:
            assert l[codec]["resumed"] == s[codec]["continued"], codec
    for codec in STATEFUL:
        # Control: residuals, PowerSGD's Q and the step counter matter; without them the run
        # differs, so the equality above is the hook state's doing.
        assert loaded[0][codec]["resumed_without_hook_state"] != saved[0][codec]["continued"]


@pytest.mark.parametrize("how", ["kill", "stall"])
def test_a_dead_or_stalled_rank_fails_the_others_with_a_terse_error(how, tmp_path):
    # kill: the victim's connections close and the others fail at once (TransportError).
    # stall: SIGSTOP keeps its connections open; the others fail at TERSE_TIMEOUT (TimeoutError).
    timeout = 3.0
    procs = start_ranks(3, [how, "--victim", "2", "--at-step", "3"], tmp_path,
                        env={"TERSE_TIMEOUT": str(timeout)})
    outputs = {}
    try:
        for rank in (0, 1):
            try:
                outputs[rank] = procs[rank].communicate(timeout=60)[0]
            except subprocess.TimeoutExpired:
                pytest.fail(f"rank {rank} hung after its peer died")
    finally:
        procs[2].kill()  # the stalled victim; a no-op for the dead one
        outputs[2] = procs[2].communicate()[0]
    if how == "kill":
        assert procs[2].returncode == -signal.SIGKILL, outputs[2]
    results = read_results(tmp_path, 3)
    for rank in (0, 1):
        r = results[rank]
        assert procs[rank].returncode == 3, outputs[rank]
        assert r["failed"] and r["timeout"] == timeout
        expected = "TransportError" if how == "kill" else ("TimeoutError", "TransportError")
        assert r["error_type"] in expected, r
        # The error names this rank, the peer and the tensor (or the fused group of small
        # ones); DDP re-raises it with that text.
        error = r["error"]
        assert f"rank {rank}" in error and "peer" in error, error
        assert any(f"'{name}'" in error for name in PARAMETERS) or "fused group" in error, error
        assert error in r["message"]
        if how == "kill":
            # The cause named is the dead rank, not a live peer that failed because of it.
            assert "peer 2 closed the connection" in error or "because of rank 2" in error, error
            assert f"peer {1 - rank} closed the connection" not in error, error
        assert r["seconds_to_fail"] < timeout + 5, r
        if how == "stall" and r["error_type"] == "TimeoutError":
            assert r["seconds_to_fail"] > timeout - 0.5, r


def test_different_codecs_across_ranks_are_a_mismatch_error(tmp_path):
    results = launch(2, ["mismatch"], tmp_path)
    for r in results:
        assert r["failed"] and r["is_mismatch"], r
        assert r["error_type"] == "MismatchError"
        assert "fp16" in r["error"] and "onebit" in r["error"]
        # What DDP raises carries terse's text (torch 1.13 prefixes the type's name, 2.x not).
        assert r["error"].splitlines()[0] in r["message"]


def test_spawned_ranks_bootstrap_through_a_file_store(tmp_path):
    # torch.multiprocessing with file:// rendezvous: terse finds its peers through the process
    # group's FileStore, with no MASTER_ADDR anywhere.
    argv = ["train", "fp16", "onebit:ef=1", "--steps", "4", "--out", str(tmp_path)]
    mp.spawn(ddp_worker.spawned, args=(2, f"file://{tmp_path}/rendezvous", argv), nprocs=2,
             join=True)
    results = read_results(tmp_path, 2)
    for codec in ("fp16", "onebit:ef=1"):
        assert results[0][codec]["digest"] == results[1][codec]["digest"]


# ---- DDP's features with the hook --------------------------------------------------------------

FEATURE_STEPS = 6


@pytest.fixture(scope="module")
def features(tmp_path_factory):
    return launch(2, ["features", "--steps", str(FEATURE_STEPS)],
                  tmp_path_factory.mktemp("features"))


@pytest.mark.parametrize("mode", ["no_sync", "static_graph", "bucket_view", "join"])
def test_ddp_features_with_the_hook_match_plain_ddp(mode, features):
    # Two ranks, codec none: each average is (a + b) / 2 in DDP and in terse, so the models are
    # equal bit for bit; powersgd keeps the replicas identical and learns.
    for r in features:
        runs = r[mode]
        assert runs["none"]["digest"] == runs["ddp"]["digest"], mode
        assert runs["powersgd"]["digest"] != runs["ddp"]["digest"]  # control: lossy differs
        for codec in ("none", "powersgd"):
            assert runs[codec]["error"] == "None", runs[codec]["error"]
            losses = runs[codec]["losses"]
            assert sum(losses[-2:]) / 2 < losses[0] - 0.1, f"{mode} {codec}: {losses}"
    assert features[0][mode]["powersgd"]["digest"] == features[1][mode]["powersgd"]["digest"]


def test_hook_step_counter_counts_communicated_steps(features):
    # Join: rank r trains FEATURE_STEPS + 2 r batches; rank 0 shadows rank 1's last 2 steps, and
    # its hook counts them, so both ranks agree on where warm-up ends.
    expected = {"no_sync": FEATURE_STEPS, "static_graph": FEATURE_STEPS,
                "bucket_view": FEATURE_STEPS, "join": FEATURE_STEPS + 2}
    for r in features:
        for mode, steps in expected.items():
            for codec in ("none", "powersgd"):
                run = r[mode][codec]
                assert run["steps"] == steps, (mode, codec, run["steps"])
                # Every step submits each of DDP's buckets once. torch 2.x splits this model
                # into two buckets once it rebuilds them after the first step or two (1.13
                # keeps one), which a counter per bucket would count as more steps.
                assert run["buckets"] >= run["steps"]
                if torch.__version__ >= "2":
                    assert run["buckets"] > run["steps"], (mode, codec, run["buckets"])
    assert len(features[1]["join"]["ddp"]["losses"]) == FEATURE_STEPS + 2
    assert len(features[0]["join"]["ddp"]["losses"]) == FEATURE_STEPS


def test_no_sync_accumulation_communicates_once_per_step(features):
    # The same two micro-batches accumulated under no_sync() and summed in one backward give
    # the same gradients bit for bit; with error feedback (onebit) the models agree only if the
    # hook's residuals and counters advance once per communicated step in both.
    for r in features:
        accumulated, summed = r["no_sync"]["onebit:ef=1"], r["pair"]["onebit:ef=1"]
        assert accumulated["digest"] == summed["digest"]
        assert accumulated["steps"] == summed["steps"] == FEATURE_STEPS
        assert accumulated["digest"] != r["no_sync"]["none"]["digest"]  # control: lossy


def test_warmup_reduces_raw_then_compresses(tmp_path):
    steps = 6
    results = launch(2, ["warmup", "--steps", str(steps)], tmp_path)
    warm = steps // 2
    for r in results:
        # Warm-up steps equal plain DDP and codec none bit for bit; then PowerSGD takes over.
        assert r["warmup"]["digests"][:warm] == r["ddp"]["digests"][:warm]
        assert r["none"]["digests"] == r["ddp"]["digests"]
        assert r["warmup"]["digests"][warm] != r["ddp"]["digests"][warm]
        assert r["warmup"]["digests"][warm] != r["powersgd"]["digests"][warm]
        raw_step = r["none"]["bytes"][0]
        sent = [b - a for a, b in zip([0] + r["warmup"]["bytes"], r["warmup"]["bytes"])]
        assert sent[:warm] == [raw_step] * warm
        assert all(s < 0.1 * raw_step for s in sent[warm:]), sent
        assert r["warmup"]["steps"] == steps
        plan = dict(r["warmup"]["plan"])
        assert plan["0.weight"].startswith("powersgd") and plan["0.bias"] == "none"
        losses = r["warmup"]["losses"]
        assert sum(losses[-2:]) / 2 < losses[0] - 0.1, losses
    assert results[0]["warmup"]["digests"] == results[1]["warmup"]["digests"]


def test_resume_inside_warmup_switches_at_the_same_step(tmp_path):
    # Saved after 4 steps of a 6-step warm-up; the continued run compresses from step 6. The
    # resumed run does so only if the checkpoint carried the hook's step count.
    token = "powersgd/warmup_steps=6"
    args = ["--steps", "4", "--checkpoint", str(tmp_path / "checkpoints")]
    (tmp_path / "checkpoints").mkdir()
    saved = launch(3, ["resume", "save", token, *args], tmp_path / "save")
    loaded = launch(3, ["resume", "load", token, *args], tmp_path / "load")
    for s, l in zip(saved, loaded):
        assert l[token]["resumed"] == s[token]["continued"]
        assert l[token]["steps"] == s[token]["steps"] == 8
    assert loaded[0][token]["resumed_without_hook_state"] != saved[0][token]["continued"]


# ---- torch.compile ---------------------------------------------------------------------------

needs_compile = pytest.mark.skipif(not hasattr(torch, "compile"),
                                   reason="torch.compile does not exist before torch 2.0")


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    return launch(2, ["compile", "--steps", "3"], tmp_path_factory.mktemp("compile"),
                  timeout=300)


@needs_compile
@pytest.mark.parametrize("run", ["ddp_optimizer", "no_optimization"])
def test_compiled_ddp_with_the_hook_matches_compiled_plain_ddp(run, compiled):
    # Backend aot_eager (TERSE_TEST_COMPILE_BACKEND=inductor runs the default one); codec none on
    # two ranks equals the compiled model with DDP's allreduce bit for bit.
    for r in compiled:
        plain, hooked = r[run]["ddp"], r[run]["none"]
        assert "failed" not in hooked, hooked
        assert hooked["digest"] == plain["digest"]
        assert hooked["steps"] == 3 and hooked["buckets"] >= 3
        # DDPOptimizer compiles a graph per bucket (two here); without it, one graph.
        graphs = 2 if run == "ddp_optimizer" else 1
        assert plain["graphs"] == hooked["graphs"] == graphs, (plain["graphs"], hooked["graphs"])
    assert compiled[0][run]["none"]["digest"] == compiled[1][run]["none"]["digest"]


@needs_compile
def test_compiled_ddp_modes_without_bucket_hooks_are_refused(compiled):
    for r in compiled:
        # Compiled autograd needs the Python reducer; torch refuses the C++ one.
        assert r["compiled_autograd"]["failed"] == "RuntimeError"
        assert "python_reducer" in r["compiled_autograd"]["message"]
        # The Python reducer calls hooks per gradient and drops their futures: terse refuses.
        pr = r["python_reducer"]
        assert "optimize_ddp = 'python_reducer'" in pr["refused"]
        assert pr["error_type"] == "InvalidArgument"
        assert "Python reducer" in pr["hook"] and "optimize_ddp=True" in pr["hook"]


# ---- bad input -------------------------------------------------------------------------------

def test_ranks_whose_parameter_names_differ_fail_with_a_mismatch_error(tmp_path):
    results = launch(2, ["disagree", "names"], tmp_path)
    for r in results:
        assert r["failed"] and r["error_type"] == "MismatchError", r
        assert "'0.weight'" in r["error"] and "'layer0.weight'" in r["error"]
        assert r["error"].splitlines()[0] in r["message"]
        # The hook's timeout is 5 s; DDP's own collectives would wait 30 minutes. The margin
        # covers connecting and a first step on a busy machine.
        assert r["seconds"] < 60, r["seconds"]


def test_ranks_whose_parameter_shapes_differ_fail_before_training(tmp_path):
    # DDP compares shapes when it wraps the model, before a hook exists: the rank whose
    # parameter differs gets DDP's message naming it, the others a connection error; none hangs.
    results = launch(2, ["disagree", "shapes"], tmp_path)
    for r in results:
        assert r["failed"] and r["seconds"] < 60, r
    assert "params[2]" in results[1]["message"] and "[65, 128]" in results[1]["message"]


def test_a_sparse_gradient_is_refused_naming_the_parameter(tmp_path):
    results = launch(2, ["sparse"], tmp_path)
    for r in results:
        assert "'0.weight'" in r["refused"] and "sparse" in r["refused"]
        # A hook made without the model meets DDP's sparse bucket and refuses it on every rank.
        assert r["error_type"] == "InvalidArgument"
        assert "sparse_coo" in r["hook"] and "dense gradients only" in r["hook"]

# ---- 16-bit gradients -------------------------------------------------------------------------

# Debian's torch 1.13 cannot train a 16-bit model under DDP on CPU: its Gloo has no bfloat16
# (DDP cannot even broadcast the parameters) and its CPU matmul no float16.
TORCH_2 = int(torch.__version__.split(".")[0]) >= 2
HALF = "bfloat16"
OWN = "bf16"
HALF_CODECS = ["none", OWN, "onebit:ef=1", "minmax8", "powersgd"]


@pytest.fixture(scope="module")
def train_half(tmp_path_factory):
    if not TORCH_2:
        pytest.skip("torch 1.13: no bf16 in Gloo, no fp16 matmul on CPU")
    return launch(2, ["train", *HALF_CODECS, "--steps", str(STEPS), "--dtype", HALF],
                  tmp_path_factory.mktemp("train_half"))


def test_a_half_model_trains_with_the_hook_like_half_ddp(train_half):
    for codec in ["ddp", *HALF_CODECS]:
        digests = {r[codec]["digest"] for r in train_half}
        assert len(digests) == 1, f"{codec}: {HALF} replicas disagree: {digests}"
    r = train_half[0]
    ddp = r["ddp"]["losses"]
    assert sum(ddp[-3:]) / 3 < ddp[0] - 0.2, f"{HALF} DDP did not learn: {ddp}"
    for codec in HALF_CODECS:
        losses = r[codec]["losses"]
        assert sum(losses[-3:]) / 3 < losses[0] - 0.2, f"{codec} did not learn in {HALF}: {losses}"
    # Raw: the same gradients as DDP's 16-bit allreduce but for rounding (Gloo sums in the
    # tensor's type, terse sums each hop in fp32 and rounds it), which ten steps magnify little.
    assert max(abs(a - b) for a, b in zip(r["none"]["losses"], ddp)) < 0.05
    assert r["none"]["max_abs_diff_from_ddp"] < 0.05


def test_raw_half_gradients_travel_in_their_own_precision(train_half):
    r = train_half[0]
    plan = {name: (codec, strategy) for name, _, codec, strategy in r["none"]["plan"]}
    assert set(plan.values()) == {(OWN, "summable")}, plan
    # Two ranks: a ring sends each element once a step, 2 bytes in 16 bits (4 in fp32), plus a
    # header a message.
    fp32_bytes = 4 * r["none"]["parameters"] * STEPS
    assert r["none"]["bytes_sent"] < 0.55 * fp32_bytes
    assert r["onebit:ef=1"]["bytes_sent"] < 0.2 * r["none"]["bytes_sent"]


def test_cpu_autocast_with_fp32_master_weights_uses_the_fp32_path(tmp_path):
    results = launch(2, ["train", "none", "onebit:ef=1", "--steps", str(STEPS), "--autocast"],
                     tmp_path)
    for codec in ("ddp", "none", "onebit:ef=1"):
        assert len({r[codec]["digest"] for r in results}) == 1, codec
    r = results[0]
    # fp32 gradients of a bf16 forward: raw equals DDP exactly on two ranks, as without autocast.
    assert r["none"]["digest"] == r["ddp"]["digest"]
    for codec in ("none", "onebit:ef=1"):
        losses = r[codec]["losses"]
        assert sum(losses[-3:]) / 3 < losses[0] - 0.2, f"{codec} did not learn: {losses}"
    plan = {name: codec for name, _, codec, _ in r["none"]["plan"]}
    assert set(plan.values()) == {"none"}
