"""The harness's data: Fashion-MNIST (Debian's dataset-fashion-mnist: the demo's reader,
terse.demo.load_fashion_mnist, which needs numpy only) and the synthetic sets.

    from terse_harness.data import load_fashion_mnist
    x, y = load_fashion_mnist("train", limit=1024)   # float32 [n, 784] normalized, int64 [n]
"""

from terse.demo import CLASSES, FASHION_MNIST_DIR, load_fashion_mnist

__all__ = ["CLASSES", "FASHION_MNIST_DIR", "load_fashion_mnist", "synthetic_sequences"]


def synthetic_sequences(n: int, seed: int):
    """The pipeline benchmark's sequence task: sequences of SEQ tokens, uniform over VOCAB
    except one class token drawn with extra probability 0.08 per position; the label is that
    token (the Bayes error is well above zero, so accuracy tracks how well the model counts)."""
    import torch

    from terse_harness.models import SEQ, VOCAB

    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, VOCAB, (n,), generator=g)
    tokens = torch.randint(0, VOCAB, (n, SEQ), generator=g)
    boost = torch.rand(n, SEQ, generator=g) < 0.08
    tokens = torch.where(boost, labels[:, None].expand(n, SEQ), tokens)
    return tokens, labels
