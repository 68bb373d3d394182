"""Fashion-MNIST from Debian's dataset-fashion-mnist package (idx files, possibly gzip'd).

Used by the demo and the tests; needs numpy only.
"""

import gzip
import os
from typing import Optional, Tuple

import numpy as np

FASHION_MNIST_DIR = "/usr/share/datasets/fashion-mnist"

# Mean and standard deviation of the training images' pixels scaled to [0, 1].
_MEAN, _STD = 0.2860, 0.3530

CLASSES = ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker",
           "Bag", "Ankle boot")


def _open_idx(directory: str, stem: str):
    for name in (stem, stem + ".gz"):
        path = os.path.join(directory, name)
        if os.path.exists(path):
            return gzip.open(path, "rb") if name.endswith(".gz") else open(path, "rb")
    raise FileNotFoundError(
        f"{stem}[.gz] not found in {directory}; install Debian's dataset-fashion-mnist "
        "(scripts/install-deps.sh does) or set TERSE_FASHION_MNIST to a directory holding it")


def _read_idx(directory: str, stem: str, expected_magic: int, limit: Optional[int]) -> np.ndarray:
    with _open_idx(directory, stem) as f:
        header = f.read(4)
        magic = int.from_bytes(header, "big")
        if magic != expected_magic:
            raise ValueError(f"{stem}: idx magic {magic:#x}, expected {expected_magic:#x}")
        ndim = header[3]
        shape = [int.from_bytes(f.read(4), "big") for _ in range(ndim)]
        if limit is not None:
            shape[0] = min(shape[0], limit)
        count = int(np.prod(shape))
        data = np.frombuffer(f.read(count), dtype=np.uint8)
        if data.size != count:
            raise ValueError(f"{stem}: truncated ({data.size} of {count} bytes)")
        return data.reshape(shape)


def load_fashion_mnist(split: str = "train", limit: Optional[int] = None,
                       directory: Optional[str] = None) -> Tuple[np.ndarray, np.ndarray]:
    """(images, labels) of the "train" (60,000) or "test" (10,000) split, the first ``limit``.

    images: float32 [n, 784], normalized to zero mean and unit variance over the training set;
    labels: int64 [n] in 0..9.
    """
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', not {split!r}")
    directory = directory or os.environ.get("TERSE_FASHION_MNIST", FASHION_MNIST_DIR)
    prefix = "train" if split == "train" else "t10k"
    images = _read_idx(directory, f"{prefix}-images-idx3-ubyte", 0x803, limit)
    labels = _read_idx(directory, f"{prefix}-labels-idx1-ubyte", 0x801, limit)
    x = images.reshape(images.shape[0], -1).astype(np.float32)
    x = (x / 255.0 - _MEAN) / _STD
    return x.astype(np.float32), labels.astype(np.int64)
