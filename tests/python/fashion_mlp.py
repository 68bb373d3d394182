"""What the optimizer workers (optim_worker.py, diloco_worker.py) train: a small MLP on the
first 2,048 Fashion-MNIST test images, each rank its own batches, and a digest of tensors."""

import hashlib

import torch

from terse_harness.data import load_fashion_mnist

BATCH = 32
SAMPLES = 2048
_data = None


def data():
    global _data
    if _data is None:
        x, y = load_fashion_mnist("test", limit=SAMPLES)
        _data = torch.from_numpy(x), torch.from_numpy(y)
    return _data


def make_model() -> torch.nn.Module:
    torch.manual_seed(1234)
    return torch.nn.Sequential(torch.nn.Linear(784, 128), torch.nn.ReLU(),
                               torch.nn.Linear(128, 64), torch.nn.ReLU(),
                               torch.nn.Linear(64, 10))


def batch(step: int, rank: int, world: int):
    """Rank ``rank``'s batch of step ``step`` of a job of ``world`` ranks."""
    x, y = data()
    start = ((step * world + rank) * BATCH) % (SAMPLES - BATCH)
    return x[start:start + BATCH], y[start:start + BATCH]


def digest(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().numpy().tobytes())
    return h.hexdigest()
