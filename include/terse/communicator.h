// Point-to-point and small collective communication between the ranks of one job, over Gloo's
// TCP transport. A Communicator moves bytes only; codecs and strategies sit above it.
//
// Failure model: every wait is bounded by a timeout. When any operation fails (a peer closed its
// connection, a wait ran out of time), the communicator is failed for good: it closes every
// connection so that peers blocked on this rank fail promptly too, every pending and later call
// throws, and the first error is repeated in each later message. Errors name this rank, the peer
// and the caller's label (usually the tensor name). Before closing, a failing rank tells its
// peers which rank's failure it follows, so that a peer whose connection to it closes reports
// "peer P aborted because of rank C: ..." (C: the rank that died or stalled, or P itself after
// abort()) rather than blaming P; a peer that died, or whose failure was its own timeout (which
// Gloo ends by closing every connection at once), is reported as having closed the connection.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "terse/export.h"

namespace gloo {
class Context;
}

namespace terse {

// A key-value store reachable by every rank, used only to bootstrap connections (addresses,
// never tensor data). Implementations must be thread-safe. The Python layer adapts
// torch.distributed.Store to this interface, so keep it to what every store offers.
class TERSE_API Store {
 public:
  virtual ~Store() = default;

  // Sets key to value; visible to every rank afterwards. Each key is set once per job (a file
  // store rejects a second set of the same key).
  virtual void set(const std::string& key, std::span<const std::byte> value) = 0;

  // Returns the value of key, waiting up to timeout for some rank to set it. Throws
  // TimeoutError naming the key if it is still missing then.
  virtual std::vector<std::byte> get(const std::string& key,
                                     std::chrono::milliseconds timeout) = 0;

  // Returns once every key is set. Throws TimeoutError naming a missing key after timeout.
  virtual void wait(std::span<const std::string> keys, std::chrono::milliseconds timeout) = 0;

  // Adds delta to the counter at key (a missing key counts as 0) and returns the new value,
  // atomically across every client: the one operation that may change a key again. Used by
  // membership (terse.elastic), where survivors and joiners must agree without a leader.
  // Counters live apart from set()'s keys. Stores without it throw InvalidArgument.
  virtual std::int64_t add(const std::string& key, std::int64_t delta);
};

// A store in a directory of a file system every rank sees (single host, or a shared file
// system). The directory is created if missing; use a fresh directory per job, since keys left
// by an earlier job would be read as this job's.
TERSE_API std::shared_ptr<Store> make_file_store(const std::string& directory);

// A store served over TCP by one process (rank 0, like torch's TCPStore) and used by all.
// With is_server, this call listens on port (all interfaces; 0 picks a free port, see
// tcp_store_port) and serves until the returned object is destroyed; the server is also a
// client of itself. Clients retry connecting until timeout, so ranks may start in any order.
// Every request is bounded by timeout; failures throw TimeoutError or TransportError naming
// host:port.
//
// secret: the job secret (empty: none). With one, every connection starts with a mutual
// challenge-response: the server admits only clients that prove the same secret, and a client
// uses only a server that proves it (docs/security.md). A server with a secret refuses a client
// without one and the other way round. A refused client throws AuthenticationError naming
// host:port; the server logs the refusal on stderr (naming the client's address and why) and
// goes on serving the others. A connection that has not finished its handshake within
// min(timeout, 10 s) is closed. The secret does not encrypt: requests travel in the clear.
// terse/environment.h reads it from TERSE_JOB_SECRET (communicator_options_from_environment).
TERSE_API std::shared_ptr<Store> make_tcp_store(const std::string& host, int port, bool is_server,
                                                std::chrono::milliseconds timeout,
                                                std::string secret = {});

// The port a TCP store created by make_tcp_store listens on or talks to; -1 for other stores.
TERSE_API int tcp_store_port(const Store& store);

// A view of store whose keys all start with prefix + "/", so that several communicators (or a
// framework and terse) can share one store without their keys colliding.
TERSE_API std::shared_ptr<Store> make_prefix_store(std::string prefix,
                                                   std::shared_ptr<Store> store);

struct CommunicatorOptions {
  // Bound on every wait, including connecting. Zero means 60 s (default_timeout).
  // communicator_options_from_environment sets it from TERSE_TIMEOUT (terse/environment.h).
  std::chrono::milliseconds timeout{0};
  // Network interface whose address this rank binds and advertises. Empty means `hostname`
  // below. communicator_options_from_environment sets it from TERSE_IFNAME, else
  // GLOO_SOCKET_IFNAME.
  std::string interface;
  // Host name or address to bind when no interface is named. Empty means this machine's host
  // name, resolved as Gloo does (falls back to 127.0.0.1 if it cannot be bound).
  std::string hostname;
  // Prefix of this communicator's keys in the store: communicators sharing a store need
  // distinct prefixes, and every rank of one communicator must use the same one.
  std::string prefix = "terse";
  // The job secret (empty: none), the same on every rank. With one, each rank proves it to every
  // peer over their connection before create returns (Gloo's listener admits any process that
  // names a pair, so this is what keeps others out), and from_env's TCP store requires it too
  // (make_tcp_store). communicator_options_from_environment sets it from TERSE_JOB_SECRET;
  // `terse run` gives each job a fresh one there.
  std::string secret;
};

// The result of an asynchronous send or recv. Move-only. It refers to its Communicator, which
// must outlive it, and to the caller's buffer, which must stay valid and (for recv) untouched
// until wait returns.
class TERSE_API Request {
 public:
  Request() noexcept;
  Request(Request&&) noexcept;
  Request& operator=(Request&&) noexcept;
  // Destroying a request that was not waited for waits for it (bounded by the communicator's
  // timeout) and swallows its error, because Gloo may still write into the buffer otherwise.
  ~Request();

  // Blocks until the operation completes. A send completes when its bytes are handed to the
  // network (the peer may not have them yet); a recv when its bytes are in the buffer.
  // Throws TimeoutError after the communicator's timeout or TransportError if the peer or the
  // communicator failed; either way the communicator is failed afterwards. A peer whose
  // connection closed (it died) ends the wait within about 0.25 s, even with the transfer under
  // way. Waiting twice is a no-op; waiting on a default-constructed request is a no-op.
  void wait();
  // As above with an explicit bound. A timeout is fatal to the communicator (Gloo closes every
  // connection), so this is not a polling primitive.
  void wait(std::chrono::milliseconds timeout);

  // True until wait has returned or thrown.
  bool pending() const noexcept;

 private:
  friend class Communicator;
  struct State;
  explicit Request(std::unique_ptr<State> state) noexcept;
  std::unique_ptr<State> state_;
};

// A fully connected group of `size` processes, this one being `rank`.
//
// Threads: send, recv and Request::wait may be called from several threads at once.
// Collectives (allgatherv, broadcast, barrier) must be called by every rank in the same order,
// and not concurrently with another collective of the same communicator.
class TERSE_API Communicator {
 public:
  // Connects to every other rank through store (a collective: every rank calls it with the
  // same size and options.prefix). Returns when every rank is connected and, with
  // options.secret, every connection has proved it. Throws TimeoutError if a rank does not show
  // up within the timeout, InvalidArgument for a bad rank or size, and AuthenticationError
  // naming each peer whose connection did not prove the secret, or whose side has no secret
  // where this one has one (or the other way round): the creation fails on both sides, and a
  // connection taken over by another process fails it rather than joining.
  static std::unique_ptr<Communicator> create(int rank, int size, std::shared_ptr<Store> store,
                                              CommunicatorOptions options = {});

  // Bootstraps from torchrun's environment (see bootstrap_from_env). A process may call it any
  // number of times, with communicators alive or not: each call is a collective, and the n-th
  // call with a prefix on every rank meets the others' n-th under a key prefix of its own.
  // Only the bootstrap comes from the environment: the options are as given (pass
  // communicator_options_from_environment() for TERSE_TIMEOUT, TERSE_IFNAME and
  // TERSE_JOB_SECRET, terse/environment.h); options.secret also guards the TCP store.
  static std::unique_ptr<Communicator> from_env(CommunicatorOptions options = {});

  // Closes every connection. Requests must be finished (or destroyed) first. Peers still
  // receiving from this rank see it as failed, so end a job with barrier() first.
  ~Communicator();

  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  int rank() const noexcept;
  int size() const noexcept;
  std::chrono::milliseconds timeout() const noexcept;
  // The address this rank bound, e.g. "10.77.0.2" (for logs).
  std::string address() const;

  // Largest tag accepted by send and recv; tags map to Gloo slots.
  static constexpr std::uint64_t kMaxTag = (std::uint64_t{1} << 56) - 1;

  // Starts sending data to peer under tag. Messages between two ranks with the same tag are
  // matched in the order they were posted; different tags are independent. The peer's recv
  // buffer must be at least data.size() bytes (a larger message is a protocol error that Gloo
  // treats as fatal to the process). Zero-byte messages are allowed. label names the payload
  // (the tensor) in error messages. Throws InvalidArgument for a bad peer or tag, and
  // TransportError if the communicator has failed.
  Request send(int peer, std::uint64_t tag, std::span<const std::byte> data,
               std::string_view label = {});

  // Starts receiving the next message from peer under tag into data (see send). The message
  // may be shorter than data; its length is not reported, so protocols carry it themselves
  // (codec payloads do, in their header).
  Request recv(int peer, std::uint64_t tag, std::span<std::byte> data,
               std::string_view label = {});

  // Gathers every rank's input into output, in rank order: rank i contributes sizes[i] bytes
  // (zero allowed), input.size() must equal sizes[rank()] and output.size() the sum of sizes.
  // input may alias its own slot of output. Uses a ring: each rank sends and receives
  // (size-1)/size of the output. Blocks; throws as Request::wait does.
  void allgatherv(std::span<const std::byte> input, std::span<std::byte> output,
                  std::span<const std::size_t> sizes, std::string_view label = {});

  // Copies root's data into data on every rank; every rank passes the same size.
  void broadcast(int root, std::span<std::byte> data, std::string_view label = {});

  // Returns once every rank has entered the barrier.
  void barrier(std::string_view label = {});

  // Fails the communicator now (e.g. because this rank hit an error of its own): every pending
  // and later operation here throws TransportError with reason, and peers blocked on this rank
  // fail promptly. Idempotent and thread-safe.
  void abort(std::string_view reason) noexcept;

  // True once an operation has failed or abort was called.
  bool failed() const noexcept;
  // Once failed: the rank whose failure this one follows (a peer that died, stalled or aborted,
  // or this rank itself after abort() or an error of its own); -1 before, or where unknown.
  int failed_because_of() const noexcept;
  // Where each rank runs, appended wherever an error names a peer that died, stalled or
  // aborted (the engine sets "host H of N, with ranks ..." once the ranks agreed on the
  // topology). One entry per rank; an empty entry or vector adds nothing.
  void set_peer_places(std::vector<std::string> places);

  struct Impl;

 private:
  friend TERSE_API std::shared_ptr<gloo::Context> gloo_context(Communicator& comm);
  explicit Communicator(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// What torchrun's environment says: RANK, WORLD_SIZE, and a store from either TERSE_FILE_STORE
// (a directory, for single-host runs) or MASTER_ADDR and MASTER_PORT, where rank 0 serves a TCP
// store (unless TERSE_STORE_SERVED=1: the launcher serves it, and rank 0 is a client). The store is made once per process and environment and lives until the process exits
// (rank 0 keeps serving MASTER_PORT): every later call returns the same one, so several
// communicators share it (with distinct prefixes). secret guards the TCP store (make_tcp_store;
// the job secret is not read from the environment here: communicator_options_from_environment
// does that). Throws InvalidArgument naming a missing or malformed variable, or a secret other
// than the one the store was made with.
struct Bootstrap {
  int rank = 0;
  int size = 1;
  std::shared_ptr<Store> store;
};
TERSE_API Bootstrap bootstrap_from_env(std::chrono::milliseconds timeout,
                                       const std::string& secret = {});

// The Gloo context under a communicator, so that benchmarks can run Gloo's own algorithms on
// the same connections (they use Gloo's slots, which terse's tags never collide with).
TERSE_API std::shared_ptr<gloo::Context> gloo_context(Communicator& comm);

// The timeout CommunicatorOptions{} resolves to: 60 s (the environment's, TERSE_TIMEOUT, is
// communicator_options_from_environment().timeout).
TERSE_API std::chrono::milliseconds default_timeout();

}  // namespace terse
