"""terse with torch in one process: zero-copy tensors, the torch.distributed.Store adapter, and
the DDP hook on a one-rank process group (its multi-rank behaviour is in test_ddp.py)."""

import datetime
import threading

import pytest
import torch
import torch.distributed as dist

import terse
import terse.torch

TIMEOUT = 10.0


@pytest.fixture
def engine(tmp_path):
    comm = terse.Communicator(0, 1, terse.file_store(str(tmp_path)), timeout=TIMEOUT)
    with terse.Engine(comm) as e:
        yield e


def test_tensors_are_reduced_in_place_without_copies(engine):
    t = torch.linspace(-3, 3, 5000)
    address = t.data_ptr()
    expected = t.half().float()
    engine.allreduce("t", t, codec="fp16").wait()
    assert t.data_ptr() == address
    assert torch.equal(t, expected)
    # A view at an offset into a larger tensor is reduced where it lies.
    big = torch.ones(100)
    engine.allreduce("view", big[10:20], codec="none", average=False).wait()
    assert torch.equal(big, torch.ones(100))


def test_half_tensors_are_reduced_in_place_in_their_own_dtype(engine):
    for dtype, own in ((torch.bfloat16, "bf16"), (torch.float16, "fp16")):
        t = torch.linspace(-3, 3, 5000).to(dtype)
        original, address = t.clone(), t.data_ptr()
        engine.allreduce(f"raw {own}", t).wait()  # one rank: the average is the input
        assert t.data_ptr() == address and torch.equal(t, original)
        plan = engine.plan(5000, dtype=dtype)  # raw travels in the tensor's own format
        assert (plan.codec, plan.strategy) == (own, "summable")
        assert engine.plan(5000, dtype=str(dtype)).codec == own
        # A lossy codec gives the fp32 path's result on the same values, rounded once.
        wide = t.float()
        engine.allreduce(f"fp32 {own}", wide, codec="onebit").wait()
        engine.allreduce(f"onebit {own}", t, codec="onebit").wait()
        assert torch.equal(t, wide.to(dtype))
        assert not torch.equal(t, original)


def test_unsupported_dtypes_are_refused_naming_the_tensor_and_what_is_supported(engine):
    supported = "terse reduces torch.float32, torch.float16 and torch.bfloat16"
    for dtype in (torch.float64, torch.int32, torch.int64, torch.uint8):
        with pytest.raises(TypeError, match=f"tensor 'g': dtype is {dtype}, {supported}"):
            engine.allreduce("g", torch.zeros(4, dtype=dtype))
        with pytest.raises(TypeError, match=f"tensor 'g2': dtype is {dtype}, {supported}"):
            engine.allreduce_group([("g1", torch.zeros(4)), ("g2", torch.zeros(4, dtype=dtype))])


def test_unsuitable_tensors_are_refused(engine):
    with pytest.raises(TypeError, match="tensor 'd': dtype is torch.float64"):
        engine.allreduce("d", torch.zeros(4, dtype=torch.float64))
    with pytest.raises(terse.InvalidArgument, match="tensor 't' is not contiguous"):
        engine.allreduce("t", torch.zeros(4, 3).t())


def test_a_torch_tcp_store_bootstraps_terse():
    server = dist.TCPStore("127.0.0.1", 0, 2, True, datetime.timedelta(seconds=TIMEOUT),
                           wait_for_workers=False)
    client = dist.TCPStore("127.0.0.1", server.port, 2, False,
                           datetime.timedelta(seconds=TIMEOUT))
    results = [None, None]

    def rank(r: int, store) -> None:
        adapted = terse.python_store(dist.PrefixStore("terse", store))
        comm = terse.Communicator(r, 2, adapted, timeout=TIMEOUT)
        t = torch.full((1000,), float(r))
        with terse.Engine(comm) as e:
            e.allreduce("t", t).wait()
        results[r] = t

    threads = [threading.Thread(target=rank, args=(r, s)) for r, s in ((0, server), (1, client))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(3 * TIMEOUT)
    assert results[0] is not None and results[1] is not None
    assert torch.equal(results[0], torch.full((1000,), 0.5))
    assert torch.equal(results[0], results[1])


def test_a_torch_store_timeout_is_a_terse_timeout():
    store = dist.TCPStore("127.0.0.1", 0, 1, True, datetime.timedelta(seconds=TIMEOUT))
    adapted = terse.python_store(store)
    with pytest.raises(terse.TimeoutError, match="never-set"):
        adapted.get("never-set", timeout=0.3)


def test_without_a_process_group_or_environment_the_hook_says_what_to_do(monkeypatch):
    for var in ("MASTER_ADDR", "TERSE_FILE_STORE"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(terse.InvalidArgument, match="init_process_group"):
        terse.torch.ddp_hook(codec="fp16")
    with pytest.raises(terse.SpecError, match="unknown codec"):
        terse.torch.ddp_hook(codec="fp17")


@pytest.fixture(scope="module")
def one_rank_group(tmp_path_factory):
    path = tmp_path_factory.mktemp("pg") / "store"
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def make_ddp(dtype=torch.float32):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(784, 128), torch.nn.ReLU(),
                                torch.nn.Linear(128, 10)).to(dtype)
    return torch.nn.parallel.DistributedDataParallel(model)


def hooked(codec: str, dtype=torch.float32, **knobs):
    """A one-rank DDP model with the terse hook, and the hook's state."""
    model = make_ddp(dtype)
    state, hook = terse.torch.ddp_hook(model, codec=codec, timeout=TIMEOUT, **knobs)
    model.register_comm_hook(state, hook)
    return model, state


def backward(model, x=None) -> None:
    x = torch.randn(4, 784) if x is None else x
    x = x.to(next(model.parameters()).dtype)
    torch.nn.functional.cross_entropy(model(x), torch.randint(0, 10, (len(x),))).backward()


def planned(state):
    return {name: p for name, _, p in state.plan()}


def test_hook_plans_per_parameter_and_matches_plain_ddp(one_rank_group):
    reference = make_ddp()
    model, state = hooked("onebit:ef=1")
    x, y = torch.randn(16, 784), torch.randint(0, 10, (16,))
    for m in (reference, model):
        torch.nn.functional.cross_entropy(m(x), y).backward()
    plan = planned(state)
    assert set(plan) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    assert plan["0.weight"].codec.startswith("onebit") and plan["0.weight"].strategy == "sharded"
    for small in ("0.bias", "2.weight", "2.bias"):  # under min_bytes (64 KiB): raw
        assert (plan[small].codec, plan[small].strategy) == ("none", "raw")
    # One rank: raw tensors come back unchanged; the onebit weight is its 1-bit approximation.
    for (name, p), r in zip(model.module.named_parameters(), reference.module.parameters()):
        if name == "0.weight":
            # onebit (chunk=1024, scale=mean): one magnitude per chunk of 1024 elements.
            assert p.grad.abs().unique().numel() <= 100352 // 1024 + 1
            assert r.grad.abs().unique().numel() > 1000
        else:
            assert torch.equal(p.grad, r.grad), name
    assert state.steps >= 1 and state.error is None
    state.close()


# Debian's torch 1.13 cannot train a 16-bit model under DDP on CPU: its Gloo has no bfloat16
# (DDP cannot even broadcast the parameters) and its CPU matmul no float16.
TORCH_2 = int(torch.__version__.split(".")[0]) >= 2


@pytest.mark.skipif(not TORCH_2, reason="torch 1.13: no bf16 in Gloo, no fp16 matmul on CPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_hook_reduces_a_half_model_in_its_own_dtype(one_rank_group, dtype):
    own = "bf16" if dtype == torch.bfloat16 else "fp16"
    reference = make_ddp(dtype)
    model, state = hooked("onebit:ef=1", dtype)
    x, y = torch.randn(16, 784, dtype=dtype), torch.randint(0, 10, (16,))
    for m in (reference, model):
        torch.nn.functional.cross_entropy(m(x), y).backward()
    plan = planned(state)
    assert plan["0.weight"].codec.startswith("onebit")
    for small in ("0.bias", "2.weight", "2.bias"):  # raw, in the bucket's own precision
        assert (plan[small].codec, plan[small].strategy) == (own, "summable")
    for (name, p), r in zip(model.module.named_parameters(), reference.module.parameters()):
        assert p.grad.dtype == dtype
        if name == "0.weight":
            assert p.grad.float().abs().unique().numel() <= 100352 // 1024 + 1
        else:
            assert torch.equal(p.grad, r.grad), name
    assert state.error is None
    state.close()


def test_hook_refuses_a_float64_model_naming_the_parameter(one_rank_group):
    # Given the model, ddp_hook refuses it before connecting.
    with pytest.raises(TypeError, match="parameter '0.weight' is torch.float64; the hook reduces "
                                        "torch.float32, torch.float16, torch.bfloat16"):
        hooked("fp16", torch.float64)
    # Without it, the hook's check of each bucket refuses it in backward (DDP may wrap the error
    # in a RuntimeError with the same text), naming the parameter by its number and shape.
    model = make_ddp(torch.float64)
    state, hook = terse.torch.ddp_hook(codec="fp16", timeout=TIMEOUT)
    model.register_comm_hook(state, hook)
    with pytest.raises((TypeError, RuntimeError),
                       match=r"parameter 'param\d+\[[0-9, ]+\]' is torch.float64"):
        backward(model)
    assert isinstance(state.error, TypeError)
    state.close()


def test_hook_errors_fail_backward_and_keep_their_type(one_rank_group):
    model, state = hooked("fp16")
    x = torch.randn(4, 784)
    x[0, 0] = float("nan")
    with pytest.raises(RuntimeError, match="InvalidArgument: rank 0: allreduce of tensor "
                                           "'0.weight'.*NaN or Inf"):
        backward(model, x)
    assert isinstance(state.error, terse.InvalidArgument)
    state.close()


def test_hook_state_checks_what_it_loads(one_rank_group):
    model, state = hooked("powersgd")
    backward(model)
    # PowerSGD views each weight as a matrix of shape[0] rows, as PyTorch's hook does.
    assert "rows=128" in planned(state)["0.weight"].codec
    saved = state.state_dict()
    assert saved["codec"] == "powersgd" and len(saved["engine"]) > 128 * 4
    state.load_state_dict(saved)
    with pytest.raises(terse.MismatchError, match="codec='fp16'"):
        state.load_state_dict(dict(saved, codec="fp16"))
    with pytest.raises(terse.DecodeError, match="version"):
        state.load_state_dict(dict(saved, version=99))
    with pytest.raises(terse.DecodeError):
        state.load_state_dict(dict(saved, engine=b"\0" * 40))
    state.close()


def test_auto_passes_through_to_the_engine(one_rank_group):
    model, state = hooked("auto")
    backward(model)
    # The engine's planner decides; on one rank nothing crosses a link, so it reduces raw.
    plan = planned(state)["0.weight"]
    assert (plan.codec, plan.strategy) == ("none", "raw")
    state.close()


def test_auto_codecs_choose_what_auto_may_use(one_rank_group):
    # Canonical specs reach the engine's planner; PowerSGD (multi-round) is allowed.
    options = terse.EngineOptions(auto_codecs=["powersgd", "fp16"])
    assert options.auto_codecs == [terse.canonical_spec("powersgd"), terse.canonical_spec("fp16")]
    assert terse.EngineOptions().auto_codecs == []
    with pytest.raises(terse.SpecError, match="nosuch"):
        terse.EngineOptions(auto_codecs=["nosuch"])
    with pytest.raises(terse.InvalidArgument, match="auto_codecs is for codec='auto'"):
        terse.torch.ddp_hook(codec="fp16", auto_codecs=["fp16"])
    model, state = hooked("auto", auto_codecs=["powersgd"])
    backward(model)
    saved = state.state_dict()
    assert saved["auto_codecs"] == [terse.canonical_spec("powersgd")]
    state.load_state_dict(saved)
    # A checkpoint of a hook that may choose other codecs is not this hook's.
    with pytest.raises(terse.MismatchError, match="auto_codecs"):
        state.load_state_dict(dict(saved, auto_codecs=[]))
    state.close()


def test_heavy_codecs_choose_what_auto_heavy_may_use_as_well(one_rank_group):
    options = terse.EngineOptions(auto_codecs=["fp16"], heavy_codecs=["onebit:ef=1"])
    assert options.auto_codecs == ["fp16"]
    assert options.heavy_codecs == [terse.canonical_spec("onebit:ef=1")]
    assert terse.EngineOptions().heavy_codecs == []
    # ["none"]: no heavy codec; a codec in both lists is light.
    assert terse.EngineOptions(auto_codecs=["fp16"], heavy_codecs=["none"]).heavy_codecs == []
    assert terse.EngineOptions(auto_codecs=["fp16", "onebit:ef=1"],
                               heavy_codecs=["onebit:ef=1"]).heavy_codecs == []
    with pytest.raises(terse.SpecError, match="nosuch"):
        terse.EngineOptions(heavy_codecs=["nosuch"])
    with pytest.raises(terse.InvalidArgument, match="heavy_codecs is for codec='auto'"):
        terse.torch.ddp_hook(codec="fp16", heavy_codecs=["onebit:ef=1"])
    model, state = hooked("auto:heavy", auto_codecs=["fp16"], heavy_codecs=["onebit:ef=1"])
    backward(model)
    # On one rank nothing crosses a link: raw, whichever tier.
    plan = planned(state)["0.weight"]
    assert (plan.codec, plan.strategy) == ("none", "raw")
    saved = state.state_dict()
    assert saved["heavy_codecs"] == [terse.canonical_spec("onebit:ef=1")]
    state.load_state_dict(saved)
    with pytest.raises(terse.MismatchError, match="heavy_codecs"):
        state.load_state_dict(dict(saved, heavy_codecs=[]))
    state.close()


def test_gather_bytes_reaches_the_engine_options(one_rank_group):
    assert terse.EngineOptions().gather_bytes == 16 << 10
    assert terse.EngineOptions(gather_bytes=0).gather_bytes == 0
    assert terse.EngineOptions(gather_bytes=1 << 20).gather_bytes == 1 << 20
    # The hook builds its engine with it (0: every raw message rings); training still works.
    model, state = hooked("none", gather_bytes=0)
    assert state.engine.options.gather_bytes == 0
    backward(model)
    assert state.error is None
    state.close()
    # The other engine knobs reach it too, and the default is the engine's default.
    model, state = hooked("none", seed=7, threads=1, fuse_bytes=1 << 16, partition_bytes=1 << 16,
                          keep_input_on_error=True)
    options = state.engine.options
    assert options.gather_bytes == 16 << 10
    assert (options.seed, options.threads, options.fuse_bytes, options.partition_bytes,
            options.keep_input_on_error) == (7, 1, 1 << 16, 1 << 16, True)
    # A copy: changing it changes nothing in the engine.
    options.gather_bytes = 1
    assert state.engine.options.gather_bytes == 16 << 10
    state.close()


def test_parameters_the_hook_cannot_reduce_are_refused_by_name():
    check = terse.torch.check_parameter
    check("w", torch.zeros(3))
    # A CUDA tensor cannot exist on a CPU-only machine; the "meta" device takes the same path.
    with pytest.raises(terse.InvalidArgument, match="'w' is on meta; .*CPU tensors only"):
        check("w", torch.zeros(3, device="meta"))
    for dtype in (torch.float64, torch.int32):
        with pytest.raises(TypeError, match=f"'w' is {dtype}; the hook reduces torch.float32"):
            check("w", torch.zeros(3, dtype=dtype))
    with pytest.raises(terse.InvalidArgument, match="'w' has a torch.sparse_coo gradient"):
        check("w", torch.zeros(3).to_sparse())
    # ddp_hook checks the model it is given before it connects: no process group needed.
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    with pytest.raises(TypeError, match="'1.weight' is torch.float64"):
        net[1].double()
        terse.torch.ddp_hook(net, codec="fp16")
    with pytest.raises(terse.InvalidArgument, match="'0.weight' is on meta"):
        terse.torch.ddp_hook(torch.nn.Sequential(torch.nn.Linear(4, 4, device="meta")))
    embedding = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Embedding(10, 4, sparse=True))
    with pytest.raises(terse.InvalidArgument, match="'1.weight' gets sparse gradients"):
        terse.torch.ddp_hook(embedding)


def test_warmup_reduces_raw_for_its_steps_then_compresses(one_rank_group):
    with pytest.raises(terse.InvalidArgument, match="warmup_steps"):
        terse.torch.ddp_hook(codec="fp16", warmup_steps=-1)
    reference = make_ddp()
    model, state = hooked("onebit:ef=1", warmup_steps=2)
    x, y = torch.randn(16, 784), torch.randint(0, 10, (16,))
    for step in range(3):
        for m in (reference, model):
            m.zero_grad()
            torch.nn.functional.cross_entropy(m(x), y).backward()
        same = torch.equal(model.module[0].weight.grad, reference.module[0].weight.grad)
        assert same == (step < 2), step  # raw during warm-up, one bit per element after
        assert state.steps == step + 1
    saved = state.state_dict()
    assert (saved["steps"], saved["warmup_steps"]) == (3, 2)
    state.close()
    model, state = hooked("onebit:ef=1", warmup_steps=2)
    state.load_state_dict(saved)
    assert state.steps == 3
    state.close()
    model, state = hooked("onebit:ef=1")
    with pytest.raises(terse.MismatchError, match="warmup_steps=2"):
        state.load_state_dict(saved)
    # A checkpoint from a hook without warm-up counts as warmup_steps=0 and step 0.
    state.load_state_dict({k: v for k, v in saved.items() if k not in ("steps", "warmup_steps")})
    assert state.steps == 0
    state.close()
