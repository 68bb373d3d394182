// Point-to-point exchange of fp32 tensors between two ranks, compressed by a codec: the building
// block of pipeline parallelism (activations sent forward, their gradients backward).
//
// Messages between a pair of ranks are matched by name and by order: the k-th send of "x" from
// rank a to rank b is received by the k-th recv of "x" on b from a. Every message carries a
// codec payload (header with codec id, parameter digest and element count), so a receiver that
// expects another codec or size gets a clear MismatchError instead of misread data.
//
// Promises: every wait is bounded by the communicator's timeout and its error names this rank,
// the peer and the tensor; a sender whose input holds NaN/Inf raises InvalidArgument at once and
// sends a failure message instead, so the receiver raises too rather than waiting. Thread-safe.
//
// A channel waits for, decodes and completes its messages on two threads of its own, not on an
// engine's workers: a receive may wait as long as the peer's schedule makes it, and an engine
// needs its workers free for the collectives every rank is waiting on. Local: creating a
// channel exchanges nothing.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "terse/communicator.h"
#include "terse/engine.h"
#include "terse/export.h"

namespace terse {

struct ChannelOptions {
  // Seed for stochastic codecs; the (name, message number) pair selects the stream.
  std::uint64_t seed = 0;
};

class TERSE_API Channel {
 public:
  explicit Channel(std::shared_ptr<Communicator> comm, ChannelOptions options = {});
  ~Channel();
  Channel(const Channel&) = delete;
  Channel& operator=(const Channel&) = delete;

  // Encodes x with codec (a spec; "none" sends it exactly) and starts sending it to peer. x may
  // be reused as soon as this returns (the payload is a copy). The handle completes when the
  // bytes are handed to the network.
  Handle send(int peer, const std::string& name, std::span<const float> x,
              const std::string& codec = "none");

  // Starts receiving the next message named `name` from peer into out (out.size() elements,
  // encoded with codec). out must stay valid until the handle completes; it is written only
  // when the message decoded successfully.
  Handle recv(int peer, const std::string& name, std::span<float> out,
              const std::string& codec = "none");

  // Bytes of payload this rank has sent through the channel so far.
  std::uint64_t bytes_sent() const;

  Communicator& communicator();

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace terse
