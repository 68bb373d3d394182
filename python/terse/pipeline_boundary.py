"""Both sides of a pipeline's stage boundary (:mod:`terse.pipeline`): the per-sample shape the
sender announces once, the autoencoder halves and their fitting at the end of a warm-up, Delta's
caches, and one micro-batch's activation sent (:class:`OutBoundary`) and received
(:class:`InBoundary`) with the boundary's forward compressor."""

import math
from typing import Any, List, Optional, Tuple

import torch
from torch import nn

import terse
from terse.pipeline_compressors import Autoencoder, Compressor, Delta, _along
from terse.pipeline_wire import Wire

__all__ = ["InBoundary", "OutBoundary"]

_MAX_NDIM = 7
_PCA_ROWS = 8192  # activation rows an autoencoder's initial principal components come from


class _Boundary:
    """What one side of a boundary knows: compressors, shapes, autoencoder halves, caches."""

    def __init__(self, index: int, forward: Compressor, backward: str, seed: int) -> None:
        self.index = index
        self.forward = forward
        self.backward = backward
        self.seed = seed
        self.sample_shape: Optional[Tuple[int, ...]] = None  # per-sample activation shape
        self.module: Optional[nn.Module] = None  # encoder (sender) or decoder (receiver)
        self.cache: Optional[torch.Tensor] = None  # Delta: [capacity, features]
        self.seen: Optional[torch.Tensor] = None  # Delta: bool [capacity]
        self.codec: Optional[terse.Codec] = None  # Delta: the sender's mirror of decoding

    # -- autoencoder helpers
    def ae_dims(self) -> Tuple[int, int]:
        ae = self.forward
        assert isinstance(ae, Autoencoder) and self.sample_shape is not None
        d = self.sample_shape[ae.dim if ae.dim < 0 else ae.dim - 1]
        return d, ae.code_size(d)

    def code_shape(self) -> Tuple[int, ...]:
        ae = self.forward
        assert isinstance(ae, Autoencoder) and self.sample_shape is not None
        shape = list(self.sample_shape)
        shape[ae.dim if ae.dim < 0 else ae.dim - 1] = self.ae_dims()[1]
        return tuple(shape)

    def features(self) -> int:
        assert self.sample_shape is not None
        return math.prod(self.sample_shape)

    def make_half(self, encoder: bool) -> nn.Module:
        d, k = self.ae_dims()
        # The same orthonormal basis on both sides, from the shared seed: the pair starts as a
        # projection onto a random k-dimensional subspace (replaced by principal components at
        # the end of a warm-up).
        g = torch.Generator().manual_seed(self.seed * 1000003 + self.index)
        q, _ = torch.linalg.qr(torch.randn(d, k, generator=g))
        if encoder:
            m = nn.Linear(d, k)
            with torch.no_grad():
                m.weight.copy_(q.t())
                m.bias.zero_()
        else:
            m = nn.Linear(k, d)
            with torch.no_grad():
                m.weight.copy_(q)
                m.bias.zero_()
        return m

    # -- delta helpers
    def ensure_cache(self, max_index: int, dtype: torch.dtype) -> None:
        capacity = 0 if self.cache is None else self.cache.shape[0]
        if max_index < capacity:
            return
        new_capacity = max(1024, 1 << (max_index + 1).bit_length())
        cache = torch.zeros(new_capacity, self.features(), dtype=dtype)
        seen = torch.zeros(new_capacity, dtype=torch.bool)
        if self.cache is not None:
            cache[:capacity] = self.cache
            seen[:capacity] = self.seen
        self.cache, self.seen = cache, seen


class OutBoundary(_Boundary):
    """The sending side: this stage's output goes to the next stage."""

    def __init__(self, index: int, forward: Compressor, backward: str, seed: int) -> None:
        super().__init__(index, forward, backward, seed)
        self.pca_rows: List[torch.Tensor] = []

    def learn_shape(self, y: torch.Tensor, wire: Wire) -> None:
        """This stage's output fixes the boundary's per-sample shape; the receiver learns it
        from a one-time message."""
        shape = tuple(y.shape[1:])
        if self.sample_shape is not None:
            if shape != self.sample_shape:
                raise terse.InvalidArgument(
                    f"rank {wire.rank}: stage {wire.stage} output has per-sample shape {shape}, "
                    f"earlier {self.sample_shape}; boundary shapes must stay fixed")
            return
        if len(shape) > _MAX_NDIM:
            raise terse.InvalidArgument(f"stage output of {len(shape)} dims; at most {_MAX_NDIM}")
        if y.dtype != torch.float32:
            raise TypeError(f"rank {wire.rank}: stage {wire.stage} outputs {y.dtype}; pipeline "
                            "boundaries carry float32 tensors")
        self.sample_shape = shape
        msg = torch.zeros(_MAX_NDIM + 1)
        msg[0] = len(shape)
        msg[1:1 + len(shape)] = torch.tensor(shape, dtype=torch.float32)
        wire.send_next("shape", wire.stage, msg, "none")
        if isinstance(self.forward, Autoencoder):
            self.module = self.make_half(encoder=True)

    def remember_for_pca(self, y: torch.Tensor) -> None:
        if not isinstance(self.forward, Autoencoder):
            return
        d, _ = self.ae_dims()
        self.pca_rows.append(y.detach().movedim(self.forward.dim, -1).reshape(-1, d))
        while sum(len(r) for r in self.pca_rows) - len(self.pca_rows[0]) >= _PCA_ROWS:
            self.pca_rows.pop(0)  # the most recent rows describe the trained layers best

    def fit_autoencoder(self, wire: Wire, replicas: Optional[terse.Engine]) -> None:
        """At the end of the warm-up: the encoder becomes the projection onto the principal
        components of the last activations, and the decoder (sent to the receiver) its
        transpose plus the mean. ``replicas``: the stage's replicas' engine, if any."""
        if not isinstance(self.forward, Autoencoder):
            return
        d, k = self.ae_dims()
        rows = torch.cat(self.pca_rows).double()
        self.pca_rows = []
        mean = rows.mean(0)
        if replicas is not None:
            # Replicas average their statistics so that their autoencoders stay equal.
            stats = torch.cat([mean, ((rows - mean).t() @ (rows - mean)).flatten()]).float()
            replicas.allreduce("pipeline/pca", stats).wait()
            mean = stats[:d].double()
            cov = stats[d:].view(d, d).double()
        else:
            cov = (rows - mean).t() @ (rows - mean)
        _, vectors = torch.linalg.eigh(cov)
        basis = vectors[:, -k:].flip(1).float().contiguous()  # top k, largest first
        mean = mean.float()
        with torch.no_grad():
            self.module.weight.copy_(basis.t())
            self.module.bias.copy_(-(basis.t() @ mean))
        decoder = torch.cat([basis.flatten(), mean])
        wire.send_next("aeinit", self.index, decoder, "none")

    def send(self, y: torch.Tensor, rows: Optional[torch.Tensor], eval_mode: bool,
             compressing: bool, wire: Wire) -> torch.Tensor:
        """Sends this stage's output y forward; returns the tensor whose gradient will come
        back (y, or the autoencoder's code)."""
        fwd = self.forward
        if isinstance(fwd, Autoencoder) and compressing:
            with wire.measured.phase("autoencoder"):
                code = _along(self.module, y, fwd.dim)
            wire.send_next("act", self.index, code, fwd.codec)
            return code
        if isinstance(fwd, Delta) and not eval_mode:
            self._send_delta(y.detach(), rows, compressing, wire)
            return y
        codec = fwd if isinstance(fwd, str) and compressing else "none"
        wire.send_next("act", self.index, y, codec)
        return y

    def _send_delta(self, y: torch.Tensor, rows: Optional[torch.Tensor], compressing: bool,
                    wire: Wire) -> None:
        if rows is None:
            raise terse.InvalidArgument(
                f"rank {wire.rank}: delta compression on boundary {self.index} needs the "
                "samples' indices: step(inputs, targets, indices=...) on the first stage")
        fwd = self.forward
        a = y.reshape(y.shape[0], -1)
        with wire.measured.phase("delta"):
            self.ensure_cache(int(rows.max()), fwd.cache_dtype)
            seen = self.seen[rows] if compressing else torch.zeros(len(rows), dtype=torch.bool)
            fresh = ~seen
            if fresh.any():
                full = a[fresh].contiguous()
                self.cache[rows[fresh]] = full.to(fwd.cache_dtype)
                self.seen[rows[fresh]] = True
        if fresh.any():
            wire.send_next("act", self.index, full, "none")
        if seen.any():
            with wire.measured.phase("delta"):
                if self.codec is None:
                    self.codec = terse.Codec(fwd.codec)
                old = self.cache[rows[seen]].float()
                change = (a[seen] - old).contiguous()
                decoded = torch.empty_like(change)
                self.codec.roundtrip(change, decoded)
                self.cache[rows[seen]] = (old + decoded).to(fwd.cache_dtype)
            wire.send_next("delta", self.index, change, fwd.codec)


class InBoundary(_Boundary):
    """The receiving side: this stage's input comes from the previous stage."""

    def learn_shape(self, wire: Wire) -> None:
        if self.sample_shape is not None:
            return
        msg, handle = wire.recv_prev("shape", wire.stage - 1, (_MAX_NDIM + 1,), "none")
        wire.wait(handle, "shape")
        ndim = int(msg[0].item())
        self.sample_shape = tuple(int(v) for v in msg[1:1 + ndim].tolist())
        if isinstance(self.forward, Autoencoder):
            self.module = self.make_half(encoder=False)

    def fit_autoencoder(self, wire: Wire) -> None:
        """At the end of the warm-up: the decoder the sender fitted."""
        if not isinstance(self.forward, Autoencoder):
            return
        d, k = self.ae_dims()
        decoder, handle = wire.recv_prev("aeinit", self.index, (d * k + d,), "none")
        wire.wait(handle, "aeinit")
        with torch.no_grad():
            self.module.weight.copy_(decoder[:d * k].view(d, k))
            self.module.bias.copy_(decoder[d * k:])

    def post_recvs(self, sizes: List[int], rows: List[Optional[torch.Tensor]], eval_mode: bool,
                   compressing: bool, wire: Wire) -> List[Any]:
        """Posts the receives of every micro-batch's input at once, so transfers overlap
        this stage's computation."""
        fwd = self.forward
        posted = []
        for b, r in zip(sizes, rows):
            if isinstance(fwd, Autoencoder) and compressing:
                posted.append(("ae",) + wire.recv_prev("act", self.index,
                                                       (b,) + self.code_shape(), fwd.codec))
            elif isinstance(fwd, Delta) and not eval_mode:
                if r is None:
                    raise terse.InvalidArgument(
                        f"rank {wire.rank}: delta compression on boundary {self.index} "
                        "needs the samples' indices (step(..., indices=...) on stage 0)")
                self.ensure_cache(int(r.max()), fwd.cache_dtype)
                seen = self.seen[r] if compressing else torch.zeros(len(r), dtype=torch.bool)
                # Mark fresh rows now, in the sender's order, so a sample repeated in a later
                # micro-batch of this step is a delta on both sides.
                fresh = ~seen
                full = delta = None
                if fresh.any():
                    full = wire.recv_prev("act", self.index,
                                          (int(fresh.sum()), self.features()), "none")
                if seen.any():
                    delta = wire.recv_prev("delta", self.index,
                                           (int(seen.sum()), self.features()), fwd.codec)
                self.seen[r[fresh]] = True
                posted.append(("delta", r, seen, full, delta))
            else:
                codec = fwd if isinstance(fwd, str) and compressing else "none"
                posted.append(("plain",) + wire.recv_prev("act", self.index,
                                                          (b,) + self.sample_shape, codec))
        return posted

    def take(self, posted: Any, batch: int, wire: Wire) -> Tuple[torch.Tensor, torch.Tensor]:
        """Waits for one micro-batch's input; returns (leaf whose gradient goes back, input of
        this stage's layers)."""
        kind = posted[0]
        if kind in ("plain", "ae"):
            x, handle = posted[1], posted[2]
            wire.wait(handle, "activation")
            x.requires_grad_(True)
            if kind == "ae":
                with wire.measured.phase("autoencoder"):
                    return x, _along(self.module, x, self.forward.dim)
            return x, x
        _, rows, seen, full, delta = posted
        fwd = self.forward
        with wire.measured.phase("delta"):
            if full is not None:
                wire.wait(full[1], "activation")
                self.cache[rows[~seen]] = full[0].to(fwd.cache_dtype)
            if delta is not None:
                wire.wait(delta[1], "activation")
                idx = rows[seen]
                self.cache[idx] = (self.cache[idx].float() + delta[0]).to(fwd.cache_dtype)
            x = self.cache[rows].float().view((batch,) + self.sample_shape)
        x.requires_grad_(True)
        return x, x
