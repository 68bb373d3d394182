"""A cost model of a compressed pipeline step, calibrated from a short measured run.

A GPipe step is two flow shops in a row: M micro-batches pass the forward chain stage 0, link 0,
stage 1, ..., stage S-1, then the backward chain in reverse. In a flow shop with unlimited
buffers, M identical jobs over resources with per-job times t_j finish after
``sum_j t_j + (M - 1) * max_j t_j`` (fill and drain, then one job per bottleneck time). Here
the resources are:

- each stage's thread: its layers' CPU time per micro-batch (measured: thread CPU seconds of the
  forward and backward phases, which do not depend on how busy the other processes keep the
  cores) plus the compressor's work on that thread (encode, autoencoder, delta cache);
- each boundary's link in the direction of travel: bytes / (rate x 1448/1514) + a per-message
  latency (tbf shapes Ethernet frames; a full TCP segment with timestamps carries 1448 of 1514
  bytes), less the token bucket's burst, which a link direction refills while the other phase
  runs;
- the machine's cores, shared by all stages: total CPU work per micro-batch / cores is a lower
  bound on the bottleneck time when there are more stages than cores (here 4 on 2).

1F1B interleaves both directions: one flow shop whose per-job times are forward plus backward
(each host's link then carries both directions' bytes, in opposite directions, so the link
time is the larger direction). A step adds the per-step work measured outside micro-batches
(optimizer, headers) of the slowest stage.

Calibration (:func:`calibrate`) reads the profiles the runtime writes
(``Pipeline.profile()``, one per stage) of a short run, usually uncompressed on an unshaped
link, and measures each compressor's own costs on this machine with tensors of the boundary's
size (``terse.Codec`` for codecs; the autoencoder's matrix products; the delta cache's gathers,
round trip and scatters). :func:`predict` then gives the step time of any compressor on any
link rate, before running it.
"""

import functools
import math
import statistics
import subprocess
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

# TCP payload per Ethernet frame under tbf: 1500-byte MTU minus IPv4 (20) and TCP with
# timestamps (32) headers, over the 1514 bytes tbf counts (Ethernet header included).
TCP_EFFICIENCY = 1448 / 1514
# An unshaped veth pair between namespaces (shared/CLUSTER.md, iperf3): about 12.5 Gbit/s.
UNSHAPED_BPS = 12.5e9
# Fixed cost of one message besides its bytes: Gloo's send/recv rendezvous on an idle link and
# the channel's two-part framing, measured on loopback (about 0.1 ms).
MESSAGE_SECONDS = 1e-4
# Bytes a channel message adds to the codec payload: the 24-byte codec header is inside the
# payload already; Gloo's per-message framing adds about this many.
MESSAGE_OVERHEAD_BYTES = 64
# CPU the kernel spends moving a byte through TCP on both hosts (copies, checksums, veth):
# about 1 ns/B on this machine's cores (a few GB/s per core each way). It takes cores, not a
# stage's thread.
KERNEL_SECONDS_PER_BYTE = 1e-9


@functools.lru_cache(maxsize=None)
def tbf_burst_bytes(rate_bps: float) -> float:
    """The token bucket scripts/cluster.sh gives a link of this rate (its rule lives there;
    ``cluster.sh -k RATE`` prints it). A link direction idles while the other phase of a GPipe
    step runs, so each phase starts with a full bucket, whose bytes leave at line rate. An
    installed package has no cluster.sh (a build tree's knows the source tree's): its links are
    taken for real ones, without a bucket."""
    from terse import _paths

    if rate_bps >= UNSHAPED_BPS or not _paths.CLUSTER_SCRIPT:
        return 0.0
    out = subprocess.run(["bash", _paths.CLUSTER_SCRIPT, "-k", f"{int(rate_bps)}bit"],
                         stdout=subprocess.PIPE, text=True, check=True, timeout=30)
    return float(out.stdout.strip())


def parse_rate(text: str) -> float:
    """Bits per second of a tc-style rate: '100mbit', '1gbit', 'unshaped' (or 'loopback')."""
    t = text.strip().lower()
    if t in ("unshaped", "loopback", "none", ""):
        return UNSHAPED_BPS
    for unit, scale in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3), ("bit", 1.0)):
        if t.endswith(unit):
            return float(t[:-len(unit)]) * scale
    raise ValueError(f"rate '{text}': use a number with gbit, mbit or kbit, or 'unshaped'")


@dataclass
class CompressorCost:
    """What one compressor costs on one boundary, per micro-batch."""

    name: str
    forward_bytes: float  # payload bytes of the activation (or code) message(s)
    backward_bytes: float  # payload bytes of the gradient message
    sender_forward: float  # seconds on the sending stage's thread (encode, encoder, delta)
    sender_backward: float  # encoder backward, decoding of nothing: the sender's extra backward
    receiver_forward: float  # decoder, delta cache update on the receiver's thread
    receiver_backward: float  # decoder backward and encoding of the gradient
    off_thread: float  # decoding on channel threads: competes for cores, not on a stage thread


@dataclass
class StageTimes:
    forward: float  # CPU seconds per micro-batch
    backward: float
    per_step: float  # CPU seconds per step outside micro-batches (optimizer, headers)


@dataclass
class Calibration:
    """Everything the model needs, from a measured run and micro-benchmarks."""

    stages: List[StageTimes]
    boundary_elements: List[int]  # activation elements per micro-batch at each boundary
    sample_shapes: List[List[int]]
    micro_batches: int
    micro_batch: int  # samples per micro-batch
    costs: Dict[str, List[CompressorCost]] = field(default_factory=dict)  # per boundary
    # Cores the stages effectively get, fitted so that the calibration run's own step time is
    # reproduced (the machine's cores minus what other work took meanwhile).
    cores: float = 2.0


def _median_seconds(f, reps: int = 5) -> float:
    """Median thread CPU seconds of f(): CPU time, not wall time, so that other processes on
    the cores (the stages of a running job, other users) do not inflate the figure."""
    f()  # warm: first touch of buffers, lazy initialization
    times = []
    for _ in range(reps):
        t = time.thread_time()
        f()
        times.append(time.thread_time() - t)
    return statistics.median(times)


def measure_compressor(spec: str, sample_shape: Sequence[int], micro_batch: int,
                       backward: str = "none", steady: bool = True) -> CompressorCost:
    """Measures one compressor on a boundary of this shape on this machine (single thread).

    ``steady``: for delta compression, the cost once every sample was seen (deltas); False
    gives the first epoch's (full fp32 sends)."""
    import torch

    import terse
    from terse.pipeline import Autoencoder, Delta, parse_compressor

    torch.set_num_threads(1)
    compressor = parse_compressor(spec)
    n = micro_batch * math.prod(sample_shape)
    g = torch.Generator().manual_seed(0)
    # ReLU-like activations: half zeros, the rest positive with a spread of magnitudes.
    x = torch.relu(torch.randn(n, generator=g))
    grad = torch.randn(n, generator=g) * 1e-3

    def codec_cost(codec_spec: str, tensor: torch.Tensor):
        codec = terse.Codec(codec_spec)
        payload = codec.encode(tensor)
        out = torch.empty_like(tensor)
        encode = _median_seconds(lambda: codec.encode(tensor))
        decode = _median_seconds(lambda: codec.decode(payload, out))
        return len(payload), encode, decode

    bwd_bytes, bwd_encode, bwd_decode = codec_cost(backward, grad)
    if isinstance(compressor, Autoencoder):
        # As the runtime runs it: a Linear along `dim` of [micro_batch, *sample_shape], the
        # code made contiguous for sending; backward through it with autograd.
        from terse.pipeline import _along

        dim = compressor.dim
        d = sample_shape[dim if dim < 0 else dim - 1]
        k = compressor.code_size(d)
        enc = torch.nn.Linear(d, k)
        dec = torch.nn.Linear(k, d)
        y = x.view((micro_batch, *sample_shape)).clone().requires_grad_(True)
        code_shape = list(sample_shape)
        code_shape[dim if dim < 0 else dim - 1] = k
        c = torch.randn((micro_batch, *code_shape), generator=g).requires_grad_(True)

        def forward_backward(layer, inp):
            out = _along(layer, inp, dim)
            out.backward(torch.ones_like(out))

        enc_f = _median_seconds(lambda: _along(enc, y, dim).contiguous())
        enc_fb = _median_seconds(lambda: forward_backward(enc, y))
        dec_f = _median_seconds(lambda: _along(dec, c, dim))
        dec_fb = _median_seconds(lambda: forward_backward(dec, c))
        flat = c.detach().flatten()
        code_bytes, code_encode, code_decode = codec_cost(compressor.codec, flat)
        code_grad_bytes, cg_encode, cg_decode = codec_cost(backward, flat * 1e-3)
        return CompressorCost(
            str(compressor), code_bytes, code_grad_bytes, enc_f + code_encode,
            max(0.0, enc_fb - enc_f), dec_f, max(0.0, dec_fb - dec_f) + cg_encode,
            code_decode + cg_decode)
    if isinstance(compressor, Delta):
        codec = terse.Codec(compressor.codec)
        rows = micro_batch
        cache = torch.zeros(4 * rows, n // rows, dtype=compressor.cache_dtype)
        index = torch.randperm(4 * rows, generator=g)[:rows]
        a = x.view(rows, -1)
        decoded = torch.empty_like(a)
        if not steady:
            full_bytes = n * 4 + 24
            return CompressorCost(str(compressor), full_bytes, bwd_bytes,
                                  _median_seconds(lambda: cache.__setitem__(index, a)), 0.0,
                                  _median_seconds(lambda: cache[index].float()), bwd_encode,
                                  bwd_decode)

        def sender():
            old = cache[index].float()
            change = (a - old).contiguous()
            codec.roundtrip(change, decoded)
            cache[index] = (old + decoded).to(compressor.cache_dtype)
            codec.encode(change)  # the channel encodes the change once more

        def receiver():
            old = cache[index].float()
            cache[index] = (old + decoded).to(compressor.cache_dtype)
            cache[index].float()

        payload = codec.encode((a - cache[index].float()).contiguous())
        decode = _median_seconds(lambda: codec.decode(payload, decoded))
        return CompressorCost(str(compressor), len(payload), bwd_bytes,
                              _median_seconds(sender), 0.0, _median_seconds(receiver),
                              bwd_encode, decode + bwd_decode)
    fwd_bytes, fwd_encode, fwd_decode = codec_cost(compressor, x)
    return CompressorCost(str(compressor), fwd_bytes, bwd_bytes, fwd_encode, 0.0, 0.0,
                          bwd_encode, fwd_decode + bwd_decode)


# Phases of a profile that belong to the compressor (measured separately per compressor).
_COMPRESSOR_PHASES = ("encode_act", "encode_grad", "encode_delta", "autoencoder", "delta")


def stage_times_from_profiles(profiles: Sequence[Dict[str, Any]]) -> List[StageTimes]:
    """Per-stage CPU seconds per micro-batch from the runtime's profiles (Pipeline.profile(),
    one per stage, ordered by stage). Compressor work is left out: it is measured separately,
    so a profile of any compressor calibrates the layers. The rest of step()'s CPU time
    (Python bookkeeping, posting messages, waiting) is spread over the micro-batches, half in
    each direction."""
    out = []
    for p in sorted(profiles, key=lambda p: p["stage"]):
        cpu = p["cpu_per_step"]
        m = p["micro_batches"]
        layers = cpu.get("forward", 0.0) + cpu.get("backward", 0.0)
        compressor = sum(cpu.get(k, 0.0) for k in _COMPRESSOR_PHASES)
        per_step = cpu.get("optimizer", 0.0) + cpu.get("replicas", 0.0)
        other = max(0.0, cpu.get("step", 0.0) - layers - compressor - cpu.get("replicas", 0.0))
        out.append(StageTimes((cpu.get("forward", 0.0) + other / 2) / m,
                              (cpu.get("backward", 0.0) + other / 2) / m, per_step))
    return out


def calibrate(profiles: Sequence[Dict[str, Any]], micro_batch: int, compressors: Sequence[str],
              backward: Optional[Dict[str, str]] = None, steady: bool = True,
              measured_step_seconds: Optional[float] = None, rate_bps: float = UNSHAPED_BPS,
              max_cores: float = 2.0) -> Calibration:
    """A calibration from a run's per-stage profiles plus micro-benchmarks of each compressor
    (with the given backward codec per compressor, default "none"). With the run's measured
    step time (an uncompressed run over links of rate_bps), the effective cores are fitted to
    reproduce it."""
    profiles = sorted(profiles, key=lambda p: p["stage"])
    shapes = [p["out_shape"] for p in profiles[:-1]]
    cal = Calibration(stages=stage_times_from_profiles(profiles),
                      boundary_elements=[micro_batch * math.prod(s) for s in shapes],
                      sample_shapes=shapes, micro_batches=profiles[0]["micro_batches"],
                      micro_batch=micro_batch)
    for c in sorted(set(compressors) | {"none"}):
        bwd = (backward or {}).get(c, "none")
        cal.costs[c] = [measure_compressor(c, s, micro_batch, bwd, steady) for s in shapes]
    if measured_step_seconds:
        cal.cores = fit_cores(cal, measured_step_seconds, rate_bps, max_cores)
    return cal


def fit_cores(cal: Calibration, measured: float, rate_bps: float, max_cores: float) -> float:
    """The effective core count (0.25 .. max_cores) at which the uncompressed prediction
    equals the measured step time; max_cores when even that many leave the prediction short
    (the stages' own chain then explains the step)."""
    lo, hi = 0.25, max_cores
    if predict(cal, "none", rate_bps, cores=hi).step_seconds >= measured:
        return hi
    if predict(cal, "none", rate_bps, cores=lo).step_seconds <= measured:
        return lo
    for _ in range(50):
        mid = (lo + hi) / 2
        if predict(cal, "none", rate_bps, cores=mid).step_seconds > measured:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


@dataclass
class Prediction:
    compressor: str
    step_seconds: float
    samples_per_second: float
    bottleneck: str
    forward_bytes: float  # per micro-batch, summed over boundaries
    backward_bytes: float
    detail: Dict[str, float] = field(default_factory=dict)


def _flow_shop(times: Sequence[float], jobs: int, floor: float = 0.0) -> float:
    """Makespan of `jobs` identical jobs through resources in series, with a lower bound
    `floor` on the steady-state time per job (a shared resource such as the cores)."""
    return sum(times) + (jobs - 1) * max(max(times), floor)


def predict(cal: Calibration, compressor: str, rate_bps: float, cores: Optional[float] = None,
            schedule: str = "gpipe", uncompressed_boundaries: int = 0,
            message_seconds: float = MESSAGE_SECONDS) -> Prediction:
    """Predicted step time of a pipeline with this compressor on every boundary (but the first
    ``uncompressed_boundaries``) over links of rate_bps."""
    cores = cal.cores if cores is None else cores
    S = len(cal.stages)
    M = cal.micro_batches
    costs = cal.costs[compressor]
    none_bytes = [4 * n + 24 for n in cal.boundary_elements]
    link_bps = rate_bps * TCP_EFFICIENCY / 8
    # Bytes of a phase that the full token bucket lets through at once, per micro-batch.
    free = tbf_burst_bytes(rate_bps) / M

    def link_seconds(payload: float) -> float:
        return max(0.0, payload + MESSAGE_OVERHEAD_BYTES - free) / link_bps + message_seconds

    def boundary(b: int) -> CompressorCost:
        if b < uncompressed_boundaries:
            return CompressorCost("none", none_bytes[b], none_bytes[b], 0, 0, 0, 0, 0)
        return costs[b]

    fwd_chain: List[float] = []
    bwd_chain: List[float] = []
    cpu_fwd = cpu_bwd = 0.0
    names_f: List[str] = []
    for s in range(S):
        t = cal.stages[s]
        f = t.forward
        bw = t.backward
        if s > 0:
            c = boundary(s - 1)
            f += c.receiver_forward
            bw += c.receiver_backward
        if s < S - 1:
            c = boundary(s)
            f += c.sender_forward
            bw += c.sender_backward
        fwd_chain.append(f)
        bwd_chain.append(bw)
        names_f.append(f"stage {s}")
        cpu_fwd += f
        cpu_bwd += bw
        if s < S - 1:
            c = boundary(s)
            fwd_chain.append(link_seconds(c.forward_bytes))
            bwd_chain.append(link_seconds(c.backward_bytes))
            names_f.append(f"link {s}")
            # Decoding runs on channel threads and the kernel moves the bytes: both take cores,
            # not a stage's thread.
            cpu_fwd += c.off_thread / 2 + c.forward_bytes * KERNEL_SECONDS_PER_BYTE
            cpu_bwd += c.off_thread / 2 + c.backward_bytes * KERNEL_SECONDS_PER_BYTE
    per_step = max(t.per_step for t in cal.stages)
    if schedule == "gpipe":
        t_f = _flow_shop(fwd_chain, M, cpu_fwd / cores)
        t_b = _flow_shop(bwd_chain[::-1], M, cpu_bwd / cores)
        total = t_f + t_b + per_step
        worst = max(range(len(fwd_chain)), key=lambda j: fwd_chain[j] + bwd_chain[j])
        bottleneck = (names_f[worst] if max(fwd_chain) >= cpu_fwd / cores else "cores")
        detail = {"forward_seconds": t_f, "backward_seconds": t_b, "per_step_seconds": per_step}
    else:
        both = [a + b for a, b in zip(fwd_chain, bwd_chain)]
        # A link carries the two directions on separate wires: the larger one bounds it.
        for j in range(1, len(both), 2):
            both[j] = max(fwd_chain[j], bwd_chain[j])
        total = _flow_shop(both, M, (cpu_fwd + cpu_bwd) / cores) + per_step
        worst = max(range(len(both)), key=lambda j: both[j])
        bottleneck = names_f[worst] if both[worst] >= (cpu_fwd + cpu_bwd) / cores else "cores"
        detail = {"per_step_seconds": per_step}
    fb = sum(boundary(b).forward_bytes for b in range(S - 1))
    bb = sum(boundary(b).backward_bytes for b in range(S - 1))
    detail["cores"] = cores
    return Prediction(compressor, total, M * cal.micro_batch / total, bottleneck, fb, bb, detail)
