"""The harness's data: Fashion-MNIST (Debian's dataset-fashion-mnist: the demo's reader,
terse.demo.load_fashion_mnist, which needs numpy only), the language model's text (Debian's
fortunes) and the synthetic sets.

    from terse_harness.data import load_fashion_mnist, load_text
    x, y = load_fashion_mnist("train", limit=1024)   # float32 [n, 784] normalized, int64 [n]
    text = load_text("train")                         # uint8 [n]: bytes, the LM's tokens
"""

import functools
import os

import numpy as np

from terse.demo import CLASSES, FASHION_MNIST_DIR, load_fashion_mnist

__all__ = ["CLASSES", "FASHION_MNIST_DIR", "TEXT_CORPUS_DIR", "load_fashion_mnist", "load_text",
           "synthetic_sequences"]

# Debian's fortunes package: plain-text English files of fortunes separated by lines "%".
TEXT_CORPUS_DIR = "/usr/share/games/fortunes"
TEXT_SPLITS = ("train", "validation")
VALIDATION_EVERY = 20  # every 20th fortune (index % 20 == 19) is validation text


def _corpus_files(directory: str):
    """The corpus's text files in sorted order: no .dat (strfile indexes), .u8 (links to the
    same text), other links, or directories (the offensive set's off/)."""
    if not os.path.isdir(directory):
        raise FileNotFoundError(
            f"text corpus {directory} not found; install Debian's fortunes package "
            "(scripts/install-deps.sh does) or set TERSE_TEXT_CORPUS to a directory of "
            "fortune files")
    files = []
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        if (name.endswith((".dat", ".u8")) or os.path.islink(path)
                or not os.path.isfile(path)):
            continue
        files.append(path)
    if not files:
        raise FileNotFoundError(f"text corpus {directory} holds no fortune files; install "
                                "Debian's fortunes package or set TERSE_TEXT_CORPUS")
    return files


@functools.lru_cache(maxsize=None)
def _text(directory: str, split: str) -> np.ndarray:
    parts = []
    index = 0
    for path in _corpus_files(directory):
        with open(path, "rb") as f:
            fortune = []
            for line in f.read().split(b"\n") + [b"%"]:
                if line != b"%":
                    fortune.append(line)
                    continue
                body = b"\n".join(fortune).strip(b"\n")
                fortune = []
                if not body:
                    continue
                held_out = index % VALIDATION_EVERY == VALIDATION_EVERY - 1
                if held_out == (split == "validation"):
                    parts.append(body + b"\n")
                index += 1
    return np.frombuffer(b"".join(parts), dtype=np.uint8)


def load_text(split: str = "train", directory: str = "") -> np.ndarray:
    """The language model's text as bytes (its tokens, vocabulary 256), uint8 [n]: the fortunes
    of every file of the corpus (``directory``, else ``TERSE_TEXT_CORPUS``, else Debian's
    /usr/share/games/fortunes) in sorted order, each followed by a newline; every 20th fortune
    is "validation", the others "train". Read once per process."""
    if split not in TEXT_SPLITS:
        raise ValueError(f"split must be 'train' or 'validation', not {split!r}")
    directory = directory or os.environ.get("TERSE_TEXT_CORPUS") or TEXT_CORPUS_DIR
    return _text(os.path.abspath(directory), split)


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
