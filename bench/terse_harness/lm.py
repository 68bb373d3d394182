"""The language-model workload of terse_harness.training: the byte-level GPT of the zoo
(terse_harness.models, "gpt") on Debian's fortunes (terse_harness.data.load_text), trained with
AdamW under a warm-up and cosine schedule.

* Data: the LM has no epochs. At every step each rank draws ``batch`` windows of context + 1
  bytes at random positions of the training text, from a generator seeded by (seed, step,
  rank): a run is reproducible and the ranks see different data. ``steps`` alone sets the
  length of a run (``samples`` and ``epochs`` do not apply).
* Evaluation: the mean cross-entropy (nats per byte) over EVAL_WINDOWS fixed windows of the
  validation text, evenly spaced, the same for every method and world size; rank r scores the
  windows r, r + world, ... and the sums are added with an allreduce.
* Schedule: linear warm-up over WARMUP_FRACTION of the steps (at least one), then cosine decay
  to FINAL_LR_FRACTION of the learning rate (torch.optim.lr_scheduler.LambdaLR).
"""

import math
from typing import Any, Callable, Optional, Set, Tuple

import numpy as np

EVAL_WINDOWS = 128  # validation windows (of context bytes each) per evaluation, all ranks
WARMUP_FRACTION = 0.05
FINAL_LR_FRACTION = 0.1


class TextData:
    """A rank's batches of byte windows and the validation windows of the language model."""

    def __init__(self, context: int, batch: int, seed: int, rank: int, world: int) -> None:
        from terse_harness.data import load_text

        self.context, self.batch, self.seed = context, batch, seed
        self.rank, self.world = rank, world
        self.train = load_text("train")
        self.validation = load_text("validation")
        if len(self.validation) < context + 1 or len(self.train) < context + 1:
            raise ValueError(f"the text corpus is too small for windows of {context + 1} bytes")
        self.train_size = len(self.train)
        last = len(self.validation) - (context + 1)
        self.eval_starts = [i * last // max(1, EVAL_WINDOWS - 1) for i in range(EVAL_WINDOWS)]

    steps_per_epoch = 0  # no epochs: the run's length is its steps

    def _windows(self, text: np.ndarray, starts: Any) -> Tuple[Any, Any]:
        import torch

        rows = np.stack([text[s:s + self.context + 1] for s in starts]).astype(np.int64)
        tokens = torch.from_numpy(rows)
        return tokens[:, :-1], tokens[:, 1:]

    def batch_of_step(self, step: int) -> Tuple[Any, Any]:
        """(inputs, targets) of this rank at ``step``: int64 [batch, context] each, the
        targets shifted by one byte."""
        rng = np.random.default_rng([self.seed, step, self.rank])
        starts = rng.integers(0, len(self.train) - self.context, size=self.batch)
        return self._windows(self.train, starts)

    def eval_batches(self, size: int = 16):
        """This rank's share of the validation windows, in batches of at most ``size``: as
        many batches on every rank (a sharded model's forward is a collective)."""
        mine = self.eval_starts[self.rank::self.world]
        count = -(-len(self.eval_starts[0::self.world]) // size)  # the largest share's
        for chunk in np.array_split(np.array(mine, dtype=np.int64), count):
            yield self._windows(self.validation, chunk)


def loss_of(module: Any, x: Any, y: Any, reduction: str = "mean") -> Any:
    """Cross-entropy of the next byte, computed in float32 whatever the model's dtype."""
    import torch.nn.functional as F

    logits = module(x)
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1),
                           reduction=reduction)


def evaluate_loss(module: Any, data: TextData) -> float:
    """Validation loss in nats per byte over the fixed windows, summed over every rank."""
    import torch
    import torch.distributed as dist

    module.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for x, y in data.eval_batches():
            total += float(loss_of(module, x, y, reduction="sum"))
            count += y.numel()
    module.train()
    sums = torch.tensor([total, float(count)], dtype=torch.float64)
    dist.all_reduce(sums)
    return float(sums[0] / sums[1])


def eval_steps(evaluations: int, total: int) -> Set[int]:
    """The steps after which validation loss is measured: ``evaluations`` evenly spaced over
    the run (the last at its end; the end is always evaluated)."""
    steps = {total}
    for j in range(1, max(0, evaluations) + 1):
        steps.add(max(1, round(j * total / evaluations)))
    return steps


def schedule(total: int) -> Callable[[int], float]:
    """The learning rate's factor at each step: linear warm-up over WARMUP_FRACTION of the
    ``total`` steps (at least one), then a cosine from 1 down to FINAL_LR_FRACTION."""
    warmup = max(1, round(WARMUP_FRACTION * total))

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        cosine = 0.5 * (1 + math.cos(math.pi * progress))
        return FINAL_LR_FRACTION + (1 - FINAL_LR_FRACTION) * cosine

    return factor


def adamw(parameters: Any, lr: float, betas: Tuple[float, float], weight_decay: float,
          eps: float, total: int) -> Tuple[Any, Any]:
    """(AdamW, its LambdaLR under :func:`schedule`) over ``parameters``. Decay applies to the
    matrices (and embeddings) only, not to biases and LayerNorm gains (one-dimensional)."""
    import torch

    parameters = list(parameters)
    groups = [{"params": [p for p in parameters if p.dim() >= 2], "weight_decay": weight_decay},
              {"params": [p for p in parameters if p.dim() < 2], "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW([g for g in groups if g["params"]], lr=lr, betas=betas,
                                  eps=eps)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, schedule(total))


def first_reached(curve: list, target: Optional[float]) -> Optional[dict]:
    """The first evaluation of ``curve`` at or below the ``target`` loss (None: none)."""
    if target is None:
        return None
    return next((c for c in curve if c["val_loss"] <= target), None)
