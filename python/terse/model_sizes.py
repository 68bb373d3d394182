"""Tensor sizes of a PyTorch model, as the JSON list ``terse plan --sizes FILE`` reads.

    from terse.model_sizes import write_sizes
    write_sizes(model, "sizes.json")     # [{"name": "fc1.weight", "elements": 1605632}, ...]

or from the command line, for a few built-in models (the same ones ``terse plan --model``
knows)::

    /usr/bin/python3 python/terse/model_sizes.py mlp --out sizes.json

Only parameters that receive gradients are listed, in ``model.named_parameters()`` order (the
order DDP registers them). This file needs PyTorch but not terse's C++ extension, so it runs
as a plain script.
"""

import argparse
import json
import os
import sys

if __name__ == "__main__":
    # Run as a file, its own folder comes first on sys.path, and that folder holds terse's
    # torch.py, which would shadow PyTorch itself.
    _here = os.path.dirname(os.path.abspath(__file__))
    sys.path = [p for p in sys.path if os.path.abspath(p or os.curdir) != _here]


def model_sizes(model):
    """[{"name": ..., "elements": ...}] for every parameter of model that requires a gradient."""
    return [
        {"name": name, "elements": int(p.numel())}
        for name, p in model.named_parameters()
        if p.requires_grad
    ]


def write_sizes(model, path):
    """Writes model_sizes(model) as JSON to path; returns the list."""
    sizes = model_sizes(model)
    with open(path, "w") as f:
        json.dump(sizes, f, indent=1)
        f.write("\n")
    return sizes


def _named(*layers):
    """nn.Sequential whose layers are named as given: (name, module) pairs."""
    from collections import OrderedDict

    from torch import nn

    return nn.Sequential(OrderedDict(layers))


def mlp():
    """784-2048-2048-10 multilayer perceptron (MNIST-sized input)."""
    from torch import nn

    return _named(
        ("fc1", nn.Linear(784, 2048)), ("relu1", nn.ReLU()),
        ("fc2", nn.Linear(2048, 2048)), ("relu2", nn.ReLU()),
        ("fc3", nn.Linear(2048, 10)),
    )


def cnn():
    """Two 3x3 convolutions and two linear layers for 1x28x28 images."""
    from torch import nn

    return _named(
        ("conv1", nn.Conv2d(1, 32, 3, padding=1)), ("relu1", nn.ReLU()), ("pool1", nn.MaxPool2d(2)),
        ("conv2", nn.Conv2d(32, 64, 3, padding=1)), ("relu2", nn.ReLU()), ("pool2", nn.MaxPool2d(2)),
        ("flatten", nn.Flatten()),
        ("fc1", nn.Linear(64 * 7 * 7, 128)), ("relu3", nn.ReLU()),
        ("fc2", nn.Linear(128, 10)),
    )


def vgg():
    """VGG-11 layout for 3x32x32 images (CIFAR-10): eight 3x3 convolutions, three linear."""
    from torch import nn

    layers, channels = [], 3
    for width in [64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"]:
        if width == "M":
            layers.append(nn.MaxPool2d(2))
        else:
            layers += [nn.Conv2d(channels, width, 3, padding=1), nn.ReLU()]
            channels = width
    return _named(
        ("features", nn.Sequential(*layers)), ("flatten", nn.Flatten()),
        ("classifier", nn.Sequential(
            nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))),
    )


MODELS = {"mlp": mlp, "cnn": cnn, "vgg": vgg}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model", choices=sorted(MODELS), help="a built-in model")
    parser.add_argument("--out", default="-", help="JSON file to write ('-': stdout)")
    args = parser.parse_args(argv)
    model = MODELS[args.model]()
    if args.out == "-":
        json.dump(model_sizes(model), sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        sizes = write_sizes(model, args.out)
        total = sum(s["elements"] for s in sizes)
        print(f"{args.model}: {len(sizes)} tensors, {total} elements -> {args.out}",
              file=sys.stderr)


if __name__ == "__main__":
    main()
