"""One rank of tests/python/test_trainers.py: terse's DDP hook inside a trainer, on CPU with the
Gloo backend. Each scenario trains the same MLP on a slice of Fashion-MNIST twice, with the
terse hook ("terse") and without it ("control"), and writes OUT/rank-R.json with a digest of
the parameters, the loss, and the hook's bytes and steps.

Scenarios:
  lightning   Lightning's Trainer(accelerator="cpu", devices=2, strategy="ddp"), started by
              running this script once: Lightning's launcher starts the second rank. terse
              through terse.lightning.callback; the control passes the hook the way Lightning
              documents, DDPStrategy(ddp_comm_state=..., ddp_comm_hook=...)
  accelerate  Accelerator(cpu=True, gradient_accumulation_steps=2) under
              `accelerate launch --multi_gpu` (or torchrun); terse registered on what
              accelerator.prepare returns
  hf          transformers.Trainer (a plain nn.Module returning {"loss": ...}) under torchrun;
              terse through terse.hf.register
"""

import argparse
import gc
import hashlib
import json
import os
import pathlib
from typing import Any, Dict, List, Tuple

import torch
import torch.nn.functional as F

import terse
import terse.torch
from terse_harness.data import load_fashion_mnist

SAMPLES = 1024
BATCH = 32
STEPS = 6
LR = 0.05
# Both hidden-layer weights (401 KiB and 32 KiB) are compressed; the rest travels raw.
KNOBS = dict(codec="powersgd:rank=8", min_bytes=16 << 10, threads=1, timeout=60)


def dataset() -> torch.utils.data.TensorDataset:
    x, y = load_fashion_mnist("test", limit=SAMPLES)
    return torch.utils.data.TensorDataset(torch.from_numpy(x), torch.from_numpy(y))


def make_mlp() -> torch.nn.Module:
    torch.manual_seed(1234)
    return torch.nn.Sequential(
        torch.nn.Linear(784, 128), torch.nn.ReLU(),
        torch.nn.Linear(128, 64), torch.nn.ReLU(),
        torch.nn.Linear(64, 10))


def digest(module: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for p in module.parameters():
        h.update(p.detach().float().numpy().tobytes())
    return h.hexdigest()


def fp32_bytes(module: torch.nn.Module) -> int:
    return sum(p.numel() * 4 for p in module.parameters())


def result(module: torch.nn.Module, losses: List[float], state: Any) -> Dict[str, Any]:
    return {"digest": digest(module), "losses": losses, "fp32_bytes": fp32_bytes(module),
            "bytes_sent": None if state is None else state.bytes_sent,
            "steps": None if state is None else state.steps,
            "connected": None if state is None else state.connected}


def write(out: str, rank: int, data: Dict[str, Any]) -> None:
    path = pathlib.Path(out) / f"rank-{rank}.json"
    path.write_text(json.dumps(data))


def lightning(out: str) -> Tuple[Dict[str, Any], int]:
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import DDPStrategy
    import terse.lightning

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = make_mlp()
            self.losses: List[float] = []

        def training_step(self, batch, index):
            x, y = batch
            loss = F.cross_entropy(self.net(x), y)
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=LR, momentum=0.9)

    def fit(strategy: Any, callbacks: List[Any]) -> Any:
        module = Module()
        trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=STEPS,
                             callbacks=callbacks, logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False,
                             num_sanity_val_steps=0)
        trainer.fit(module, torch.utils.data.DataLoader(dataset(), batch_size=BATCH))
        return trainer, module

    hook = terse.lightning.callback(**KNOBS)
    trainer, module = fit("ddp", [hook])
    data = {"terse": result(module.net, module.losses, hook.state)}
    # Lightning's documented door for comm hooks registers them on CUDA devices only.
    state, fn = terse.torch.ddp_hook(None, lazy=True, **KNOBS)
    trainer, module = fit(DDPStrategy(ddp_comm_state=state, ddp_comm_hook=fn), [])
    data["control"] = result(module.net, module.losses, state)
    data["world"] = trainer.world_size
    return data, trainer.global_rank


def accelerate(out: str) -> Tuple[Dict[str, Any], int]:
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)

    def train(with_terse: bool) -> Dict[str, Any]:
        model = make_mlp()
        optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
        loader = torch.utils.data.DataLoader(dataset(), batch_size=BATCH)
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        state = None
        if with_terse:
            # lazy=True: the state connects at its first bucket, inside the first synchronized
            # backward (the second micro-batch; the first runs under no_sync()). Connecting
            # here, without lazy, is test_ddp's path.
            state, hook = terse.torch.ddp_hook(model, lazy=True, **KNOBS)
            model.register_comm_hook(state, hook)
        losses = []
        batches = iter(loader)
        for _ in range(2 * STEPS):  # micro-batches: STEPS optimizer steps
            x, y = next(batches)
            with accelerator.accumulate(model):
                loss = F.cross_entropy(model(x), y)
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            losses.append(loss.item())
        return result(accelerator.unwrap_model(model), losses, state)

    data = {"terse": train(True), "control": train(False),
            "world": accelerator.num_processes, "ddp": accelerator.distributed_type.value}
    accelerator.free_memory()  # it keeps the prepared (DDP) models
    return data, accelerator.process_index


def hf(out: str) -> Tuple[Dict[str, Any], int]:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers
    import terse.hf

    class Classifier(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = make_mlp()

        def forward(self, x, labels=None):
            logits = self.net(x)
            return {"loss": F.cross_entropy(logits, labels), "logits": logits}

    class Examples(torch.utils.data.Dataset):
        def __init__(self) -> None:
            self.data = dataset()

        def __len__(self) -> int:
            return len(self.data)

        def __getitem__(self, i):
            x, y = self.data[i]
            return {"x": x, "labels": y}

    def train(with_terse: bool) -> Dict[str, Any]:
        model = Classifier()
        args = transformers.TrainingArguments(
            output_dir=os.path.join(out, "hf"), max_steps=STEPS, per_device_train_batch_size=BATCH,
            learning_rate=1e-3, use_cpu=True, report_to=[], save_strategy="no", logging_steps=1,
            disable_tqdm=True, seed=0, dataloader_num_workers=0)
        trainer = transformers.Trainer(model=model, args=args, train_dataset=Examples())
        state = terse.hf.register(trainer, **KNOBS) if with_terse else None
        trainer.train()
        losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
        return result(model.net, losses, state), trainer

    data, trainer = train(True)
    data = {"terse": data, "control": train(False)[0], "world": trainer.args.world_size}
    return data, trainer.args.process_index


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("scenario", choices=["lightning", "accelerate", "hf"])
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    scenario = {"lightning": lightning, "accelerate": accelerate, "hf": hf}[args.scenario]
    data, rank = scenario(args.out)
    write(args.out, rank, data)
    # A process group left to the interpreter's exit can abort it ("terminate called without
    # an active exception" from Gloo's threads): the DDP models that hold it go first, then
    # the group, as in every other worker.
    gc.collect()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
