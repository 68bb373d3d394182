"""The compressors of a pipeline's stage boundaries (:mod:`terse.pipeline`): a codec spec,
:class:`Autoencoder` or :class:`Delta`, and their command-line forms."""

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Union

import torch
from torch import nn

import terse

__all__ = ["Autoencoder", "Compressor", "Delta", "parse_compressor"]


@dataclass(frozen=True)
class Autoencoder:
    """A learned linear autoencoder across one boundary (forward direction).

    The encoder, ``Linear(d, k)`` applied along dimension ``dim`` of the sending stage's output,
    lives on the sender; the decoder, ``Linear(k, d)``, on the receiver; both are trained with
    the model by the same optimizer (they are in :meth:`Pipeline.parameters`). ``k`` is
    ``code`` or ``round(ratio * d)``. The code travels with ``codec`` (default ``"none"``) and
    the gradient of the code comes back with the boundary's backward compressor.

    Initialization: with warm-up steps (``Pipeline(warmup_steps=W)``), the sender fits the
    principal components of the last warm-up step's activations (encoder = projection onto the
    top k, decoder = its transpose plus the mean) and sends the decoder to the receiver; without
    warm-up, both sides build the same random orthonormal projection from the pipeline's seed.

    ``dim``: -1 for ``[batch, features]`` and ``[batch, tokens, features]`` activations, 1 for
    ``[batch, channels, height, width]`` (a 1x1 convolution over channels).
    """

    ratio: Optional[float] = 0.1
    code: Optional[int] = None
    dim: int = -1
    codec: str = "none"

    def code_size(self, d: int) -> int:
        k = self.code if self.code is not None else max(1, round(self.ratio * d))
        if not 1 <= k <= d:
            raise terse.InvalidArgument(f"autoencoder code size {k} must be in 1 .. {d}")
        return k

    def __str__(self) -> str:
        size = f"code={self.code}" if self.code is not None else f"ratio={self.ratio:g}"
        extra = f",dim={self.dim}" if self.dim != -1 else ""
        extra += f",codec={self.codec}" if self.codec != "none" else ""
        return f"ae:{size}{extra}"


@dataclass(frozen=True)
class Delta:
    """AQ-SGD's delta compression across one boundary (forward direction).

    Sender and receiver keep, per training sample (its index, given to :meth:`Pipeline.step`),
    the activation as the receiver knows it. A sample's first visit sends it in full (fp32);
    each later visit sends ``codec(activation - cached)`` and both sides add the decoded change
    to their cache, which is what the receiver computes on. So the first epoch is uncompressed,
    as the method requires, and the error never accumulates. The sender mirrors the receiver's
    decoding with :class:`terse.Codec`, so the codec must be deterministic and stateless
    (``minmax8``, ``fp16``, ``bf16``, ``topk``, ``threshold``, ``onebit``, ``tbq``, ...).

    ``cache_dtype``: ``torch.float16`` halves the caches' memory (both sides round alike).
    Evaluation (:meth:`Pipeline.predict`) sends activations in full: the caches are a training
    device and hold no test samples.
    """

    codec: str = "minmax8:bits=4"
    cache_dtype: torch.dtype = torch.float32

    def __str__(self) -> str:
        return f"delta:{self.codec}" + (":fp16cache" if self.cache_dtype == torch.float16 else "")


Compressor = Union[str, Autoencoder, Delta]


def parse_compressor(text: Union[str, Autoencoder, Delta]) -> Compressor:
    """A compressor from its command-line form.

    ``"none"`` or any codec spec (``"minmax8:bits=4"``); ``"ae:ratio=0.1"``,
    ``"ae:code=64,dim=1,codec=fp16"``; ``"delta:CODEC"`` (``"delta:minmax8:bits=4"``),
    ``"delta:CODEC:fp16cache"``. Codec specs are validated (``terse.SpecError`` lists what is
    allowed).
    """
    if not isinstance(text, str):
        return text
    if text == "ae" or text.startswith("ae:"):
        kwargs: Dict[str, Any] = {}
        body = text[3:]
        if body:
            for item in _split_ae_args(body):
                key, _, value = item.partition("=")
                if key == "ratio":
                    kwargs["ratio"] = float(value)
                elif key == "code":
                    kwargs["code"] = int(value)
                    kwargs.setdefault("ratio", None)
                elif key == "dim":
                    kwargs["dim"] = int(value)
                elif key == "codec":
                    terse.canonical_spec(value)
                    kwargs["codec"] = value
                else:
                    raise terse.SpecError(
                        f"autoencoder: unknown key '{key}' in '{text}' (allowed: ratio, code, "
                        "dim, codec)")
        return Autoencoder(**kwargs)
    if text.startswith("delta:"):
        body = text[len("delta:"):]
        dtype = torch.float32
        if body.endswith(":fp16cache"):
            body, dtype = body[:-len(":fp16cache")], torch.float16
        _check_delta_codec(body)
        return Delta(codec=body, cache_dtype=dtype)
    terse.canonical_spec(text)
    return text


def _split_ae_args(body: str) -> List[str]:
    # "code=64,codec=minmax8:bits=4,chunk=64" -> the codec takes the rest of the string.
    out: List[str] = []
    rest = body
    while rest:
        if rest.startswith("codec="):
            out.append(rest)
            break
        head, _, rest = rest.partition(",")
        out.append(head)
    return out


def _check_delta_codec(spec: str) -> None:
    codec = terse.Codec(spec)  # refuses stateful codecs (ef=1, dgc) and powersgd
    if codec.traits["stochastic"]:
        raise terse.InvalidArgument(
            f"delta compression needs a deterministic codec (the sender mirrors the receiver's "
            f"cache with its own decoding); {spec} draws random numbers")


def _along(module: nn.Module, x: torch.Tensor, dim: int) -> torch.Tensor:
    """Applies a Linear along dimension dim of x."""
    if dim == -1 or dim == x.dim() - 1:
        return module(x)
    return module(x.movedim(dim, -1)).movedim(-1, dim)
