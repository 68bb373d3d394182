"""The harness's model zoo: every network the benchmarks train and ``terse plan --model`` knows.

models.json beside this file is the one definition of each model's layer shapes: per model, its
gradient tensors in ``named_parameters()`` order (the order DDP registers them) with the names
``terse plan`` prints. The ``terse`` command embeds that file when it is built; the torch
modules built here follow it, and tests/python/test_models.py asserts that they match. A
module's own parameter names may differ from the definition's (nn.Sequential's indices for mlp
and cnn): the engine seeds each tensor's codec from its name, so the benchmarks keep the names
their published runs were made with.

    python3 -m terse_harness.models mlp --out sizes.json   # terse plan --sizes JSON of a model

The demo's MLP (terse.demo) is the zoo's mlp; the others are defined here.
"""

import argparse
import functools
import json
import os
import sys
from collections import OrderedDict
from typing import Any, Dict, List, Tuple

DEFINITIONS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "models.json")

# The pipeline benchmark's sequence task: tokens, sequence length, transformer width.
VOCAB, SEQ, D_MODEL = 16, 32, 64
PIPELINE_MLP_WIDTH = 1024
# The byte-level language model: vocabulary, context, width, blocks, heads.
GPT_VOCAB, GPT_CONTEXT, GPT_WIDTH, GPT_BLOCKS, GPT_HEADS = 256, 128, 256, 4, 4


@functools.lru_cache(maxsize=None)
def definitions() -> Dict[str, Dict[str, Any]]:
    """models.json: {name: {"description": ..., "tensors": [[name, shape], ...]}}, in file
    order."""
    with open(DEFINITIONS) as f:
        return json.load(f, object_pairs_hook=OrderedDict)


def _cnn():
    from torch import nn

    return nn.Sequential(
        nn.Unflatten(1, (1, 28, 28)),
        nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(64 * 7 * 7, 128), nn.ReLU(), nn.Linear(128, 10))


def _vgg():
    """VGG-11 for 3x32x32 images (CIFAR-10): eight 3x3 convolutions, three linear layers."""
    from torch import nn

    layers, channels = [], 3
    for width in [64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"]:
        if width == "M":
            layers.append(nn.MaxPool2d(2))
        else:
            layers += [nn.Conv2d(channels, width, 3, padding=1), nn.ReLU()]
            channels = width
    return nn.Sequential(OrderedDict([
        ("features", nn.Sequential(*layers)), ("flatten", nn.Flatten()),
        ("classifier", nn.Sequential(
            nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))),
    ]))


def _vgg_small():
    from torch import nn

    def block(cin, cout):
        return [nn.Conv2d(cin, cout, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)]

    # VGG's shape at CIFAR size: three conv blocks, then fully connected layers that hold most
    # of the parameters (and so of the gradient bytes). Each layer stays under 32 MB: glibc
    # serves larger blocks with fresh mmap()s, and autograd allocates every weight's gradient
    # anew each step, so a 4096x4096 layer (67 MB) would pay about 2 s a step in first touches
    # of fresh pages, the same for every method, burying communication under it.
    return nn.Sequential(
        *block(3, 32), *block(32, 64), *block(64, 128), nn.Flatten(),
        nn.Linear(128 * 4 * 4, 2560), nn.ReLU(), nn.Linear(2560, 2560), nn.ReLU(),
        nn.Linear(2560, 2560), nn.ReLU(), nn.Linear(2560, 10))


def _transformer():
    import torch
    import torch.nn as nn

    class PatchTransformer(nn.Module):
        """A small vision transformer: 7x7 patches of the 28x28 image (16 tokens), a learned
        position embedding, 4 pre-norm encoder layers (width 128, 4 heads, MLP 512), mean
        pooling and a linear head: 0.8 M parameters in 30 tensors."""

        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Linear(49, 128)
            self.position = nn.Parameter(torch.zeros(1, 16, 128))
            self.layers = nn.ModuleList(
                nn.TransformerEncoderLayer(128, 4, 512, dropout=0.0, batch_first=True,
                                           norm_first=True) for _ in range(4))
            self.norm = nn.LayerNorm(128)
            self.head = nn.Linear(128, 10)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            patches = x.reshape(-1, 4, 7, 4, 7).permute(0, 1, 3, 2, 4).reshape(-1, 16, 49)
            h = self.embed(patches) + self.position
            for layer in self.layers:
                h = layer(h)
            return self.head(self.norm(h).mean(1))

    return PatchTransformer()


def _pipeline_mlp():
    from torch import nn

    w = PIPELINE_MLP_WIDTH
    return nn.Sequential(nn.Linear(784, w), nn.ReLU(), nn.Linear(w, w), nn.ReLU(),
                         nn.Linear(w, w), nn.ReLU(), nn.Linear(w, 10))


def _pipeline_cnn():
    from torch import nn

    return nn.Sequential(
        nn.Unflatten(1, (1, 28, 28)), nn.Conv2d(1, 16, 5, padding=2), nn.ReLU(),
        nn.MaxPool2d(2),                                   # boundary 0: [16, 14, 14]
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(),        # boundary 1: [32, 14, 14]
        nn.MaxPool2d(2), nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(),  # 2: [64, 7, 7]
        nn.MaxPool2d(2), nn.Flatten(), nn.Linear(64 * 9, 128), nn.ReLU(),
        nn.Linear(128, 10))


def _sequence_layers():
    import torch
    from torch import nn

    class Embedding(nn.Module):
        """Token plus learned position embeddings: int64 [batch, SEQ] -> [batch, SEQ, D]."""

        def __init__(self) -> None:
            super().__init__()
            self.tokens = nn.Embedding(VOCAB, D_MODEL)
            self.positions = nn.Parameter(torch.randn(SEQ, D_MODEL) * 0.1)

        def forward(self, x):
            return self.tokens(x) + self.positions

    class MeanPool(nn.Module):
        def forward(self, x):
            return x.mean(1)

    return Embedding, MeanPool


def _pipeline_transformer():
    from torch import nn

    embedding, mean_pool = _sequence_layers()
    layers = [embedding()] + [
        nn.TransformerEncoderLayer(D_MODEL, 4, 4 * D_MODEL, dropout=0.0, batch_first=True)
        for _ in range(4)] + [mean_pool(), nn.Linear(D_MODEL, VOCAB)]
    return nn.Sequential(*layers)


def _gpt():
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    d, heads = GPT_WIDTH, GPT_HEADS
    sdpa = getattr(F, "scaled_dot_product_attention", None)  # torch 2.x; 1.13 has none
    masks: Dict[int, Any] = {}  # length -> causal mask (an attribute, not a buffer: DDP
    # would broadcast a buffer every step)

    def attention(q, k, v):
        if sdpa is not None:
            return sdpa(q, k, v, is_causal=True)
        n = q.shape[-2]
        if n not in masks:
            masks[n] = torch.ones(n, n, dtype=torch.bool).triu(1)
        scores = (q @ k.transpose(-2, -1)) / (q.shape[-1] ** 0.5)
        return scores.masked_fill(masks[n], float("-inf")).softmax(-1) @ v

    class Block(nn.Module):
        """Pre-LayerNorm decoder block: causal self-attention, then a GELU MLP of width 4d."""

        def __init__(self) -> None:
            super().__init__()
            self.ln1 = nn.LayerNorm(d)
            self.qkv = nn.Linear(d, 3 * d)
            self.proj = nn.Linear(d, d)
            self.ln2 = nn.LayerNorm(d)
            self.fc = nn.Linear(d, 4 * d)
            self.out = nn.Linear(4 * d, d)

        def forward(self, x):
            b, n, _ = x.shape
            q, k, v = (t.reshape(b, n, heads, d // heads).transpose(1, 2)
                       for t in self.qkv(self.ln1(x)).chunk(3, dim=-1))
            x = x + self.proj(attention(q, k, v).transpose(1, 2).reshape(b, n, d))
            return x + self.out(F.gelu(self.fc(self.ln2(x))))

    class GPT(nn.Module):
        """Byte-level decoder: token (256 x d) and learned position (context x d) embeddings,
        GPT_BLOCKS pre-norm blocks, a final LayerNorm and a separate output head (not tied to
        the token embedding: FSDP shards the embedding as its own unit). int64 [batch, n <=
        context] -> logits [batch, n, 256]."""

        def __init__(self) -> None:
            super().__init__()
            self.position = nn.Parameter(torch.randn(GPT_CONTEXT, d) * 0.02)
            self.tokens = nn.Embedding(GPT_VOCAB, d)
            self.blocks = nn.ModuleList(Block() for _ in range(GPT_BLOCKS))
            self.norm = nn.LayerNorm(d)
            self.head = nn.Linear(d, GPT_VOCAB, bias=False)
            for module in self.modules():
                if isinstance(module, (nn.Linear, nn.Embedding)):
                    nn.init.normal_(module.weight, std=0.02)
                if isinstance(module, nn.Linear) and module.bias is not None:
                    nn.init.zeros_(module.bias)

        def forward(self, x):
            h = self.tokens(x) + self.position[:x.shape[1]]
            for block in self.blocks:
                h = block(h)
            return self.head(self.norm(h))

    return GPT()


def _mlp():
    from terse.demo import mlp

    return mlp()


_BUILDERS = {
    "mlp": _mlp, "cnn": _cnn, "vgg": _vgg, "vgg-small": _vgg_small, "transformer": _transformer,
    "pipeline-mlp": _pipeline_mlp, "pipeline-cnn": _pipeline_cnn,
    "pipeline-transformer": _pipeline_transformer, "gpt": _gpt,
}


def names() -> List[str]:
    return list(definitions())


def build(name: str) -> Any:
    """The torch module of model ``name`` (its weights from torch's current random state)."""
    if name not in _BUILDERS:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(definitions())}")
    return _BUILDERS[name]()


def parameter_shapes(module: Any) -> List[Tuple[str, List[int]]]:
    """(name, shape) of every parameter of ``module`` that receives a gradient, in order."""
    return [(n, list(p.shape)) for n, p in module.named_parameters() if p.requires_grad]


def mismatch(name: str, module: Any) -> str:
    """Where ``module`` differs from model ``name``'s definition in shapes ("" where not)."""
    defined = [shape for _, shape in definitions()[name]["tensors"]]
    built = [shape for _, shape in parameter_shapes(module)]
    if defined == built:
        return ""
    return f"model {name}: models.json lists shapes {defined}, the torch module has {built}"


def sizes(name: str) -> List[Dict[str, Any]]:
    """``terse plan --sizes`` JSON of model ``name``: the definition's names with the element
    counts of its torch module (which must follow the definition)."""
    module = build(name)
    problem = mismatch(name, module)
    if problem:
        raise ValueError(problem)
    return [{"name": tensor, "elements": int(p.numel())}
            for (tensor, _), p in zip(definitions()[name]["tensors"],
                                      (p for p in module.parameters() if p.requires_grad))]


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python3 -m terse_harness.models",
                                     description="The --sizes JSON of a model of the zoo, as "
                                                 "`terse plan --model` sees it.")
    parser.add_argument("model", choices=names(), help="a model of models.json")
    parser.add_argument("--out", default="-", help="JSON file to write ('-': stdout)")
    args = parser.parse_args(argv)
    out = sizes(args.model)
    if args.out == "-":
        json.dump(out, sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
            f.write("\n")
        total = sum(s["elements"] for s in out)
        print(f"{args.model}: {len(out)} tensors, {total} elements -> {args.out}",
              file=sys.stderr)


if __name__ == "__main__":
    main()
