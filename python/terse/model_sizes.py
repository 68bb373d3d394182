"""Tensor sizes of a PyTorch model, as the JSON list ``terse plan --sizes FILE`` reads.

    from terse.model_sizes import write_sizes
    write_sizes(model, "sizes.json")     # [{"name": "fc1.weight", "elements": 1605632}, ...]

Only parameters that receive gradients are listed, in ``model.named_parameters()`` order (the
order DDP registers them). ``terse plan --model NAME`` knows the benchmark's models itself.
"""

import json


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
