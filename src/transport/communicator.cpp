// Communicator over Gloo's TCP transport: unbound buffers for tagged point-to-point messages,
// ring allgatherv, dissemination barrier and direct broadcast built on them, so every error can
// name the peer it came from.
#include "terse/communicator.h"

#include <arpa/inet.h>
#include <fmt/format.h>
#include <gloo/common/error.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/store.h>
#include <gloo/transport/tcp/attr.h>
#include <gloo/transport/tcp/device.h>
#include <gloo/transport/unbound_buffer.h>
#include <netinet/in.h>
#include <signal.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <numeric>
#include <thread>
#include <unordered_set>

#include "terse/error.h"
#include "transport/communicator_impl.h"
#include "transport/scheduling.h"

namespace terse {

using namespace transport;

namespace {

// torchrun's bootstrap (bootstrap_from_env) is the one reader of the environment below the
// edge (terse/environment.h): RANK, WORLD_SIZE, TERSE_FILE_STORE, MASTER_ADDR, MASTER_PORT.
std::string env(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr ? std::string(v) : std::string();
}

// Adapts a terse::Store to the interface Gloo's rendezvous calls. Gloo calls get() without a
// prior wait, so get blocks up to the communicator's timeout.
class GlooStore final : public gloo::rendezvous::Store {
 public:
  GlooStore(std::shared_ptr<terse::Store> store, milliseconds timeout)
      : store_(std::move(store)), timeout_(timeout) {}

  void set(const std::string& key, const std::vector<char>& data) override {
    store_->set(key, std::as_bytes(std::span(data)));
  }
  std::vector<char> get(const std::string& key) override {
    auto v = store_->get(key, timeout_);
    std::vector<char> out(v.size());
    if (!v.empty()) std::memcpy(out.data(), v.data(), v.size());
    return out;
  }
  void wait(const std::vector<std::string>& keys) override { store_->wait(keys, timeout_); }
  void wait(const std::vector<std::string>& keys, const milliseconds& timeout) override {
    store_->wait(keys, timeout);
  }

 private:
  std::shared_ptr<terse::Store> store_;
  milliseconds timeout_;
};

std::string address_of(const gloo::transport::tcp::attr& attr) {
  char buf[INET6_ADDRSTRLEN] = "?";
  if (attr.ai_addr.ss_family == AF_INET) {
    inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in*>(&attr.ai_addr)->sin_addr, buf,
              sizeof(buf));
  } else if (attr.ai_addr.ss_family == AF_INET6) {
    inet_ntop(AF_INET6, &reinterpret_cast<const sockaddr_in6*>(&attr.ai_addr)->sin6_addr, buf,
              sizeof(buf));
  }
  return buf;
}

}  // namespace

milliseconds default_timeout() { return std::chrono::seconds(60); }


Request::Request() noexcept = default;
Request::Request(std::unique_ptr<State> state) noexcept : state_(std::move(state)) {}
Request::Request(Request&&) noexcept = default;
Request& Request::operator=(Request&& other) noexcept {
  if (this != &other) {
    if (pending()) {
      try {
        wait();
      } catch (...) {
      }
    }
    state_ = std::move(other.state_);
  }
  return *this;
}

Request::~Request() {
  if (pending()) {
    try {
      wait();
    } catch (...) {
      // The communicator is failed now; the error was or will be seen by another wait.
    }
  }
}

bool Request::pending() const noexcept { return state_ && !state_->done; }

void Request::wait() {
  if (!pending()) return;
  wait(state_->comm->timeout);
}

void Request::wait(milliseconds timeout) {
  if (!pending()) return;
  State& s = *state_;
  s.done = true;
  const bool failed_before = s.comm->failed.load();
  std::string gloo_message;
  bool ok = false;
  {
    std::lock_guard lock(s.comm->live_mutex);
    s.waiting_since = Clock::now();
  }
  try {
    ok = s.is_send ? s.buffer->waitSend(nullptr, timeout) : s.buffer->waitRecv(nullptr, timeout);
  } catch (const std::exception& e) {
    gloo_message = e.what();
  }
  bool aborted = false;
  {
    std::lock_guard lock(s.comm->live_mutex);
    s.comm->live.erase(&s);
    aborted = s.aborted;
    if (!ok && gloo_message.empty() && aborted) gloo_message = s.abort_error;
  }
  if (ok) return;
  // Tell apart: this communicator failed earlier or meanwhile (our abort closed the pairs and
  // ended this wait), a timeout here, and a peer that closed its connection (Gloo's error, or
  // the watchdog's for a transfer Gloo did not wake).
  if (failed_before || (aborted && gloo_message.empty()) ||
      (s.comm->failed.load() && contains(gloo_message, "Application timeout"))) {
    throw TransportError(fmt::format("{} failed because the communicator had failed: {}",
                                     s.describe(), s.comm->failure()));
  }
  if (gloo_message.empty()) gloo_message = "wait aborted";
  std::string msg;
  if (contains(gloo_message, "Timed out")) {
    msg = fmt::format(
        "{} timed out after {} ms: peer {}{} stalled, died, or did not post the matching {}",
        s.describe(), timeout.count(), s.peer, s.comm->place_of(s.peer),
        s.is_send ? "recv" : "send");
    s.comm->fail(msg, s.peer, msg);
    throw TimeoutError(msg);
  }
  int cause = s.peer;
  std::string origin;
  if (contains(gloo_message, "closed by peer") || contains(gloo_message, "Connection reset") ||
      contains(gloo_message, "Read error") || contains(gloo_message, "writev")) {
    const std::string why = s.comm->closed_by(s.peer, cause, origin);
    msg = fmt::format("{} failed: {} [{}]", s.describe(), why, gloo_message);
  } else {
    msg = fmt::format("{} failed: {}", s.describe(), gloo_message);
  }
  s.comm->fail(msg, cause, origin.empty() ? msg : origin);
  throw TransportError(msg);
}


Request Communicator::Impl::post(bool is_send, int peer, std::uint64_t slot, std::uint64_t tag,
                                 void* ptr, std::size_t bytes, std::string_view label,
                                 const char* operation) {
  Impl& c = *this;
  auto state = std::make_unique<Request::State>();
  state->comm = &c;
  state->is_send = is_send;
  state->peer = peer;
  state->tag = tag;
  state->operation = operation;
  state->label = label;
  try {
    state->buffer = c.context->createUnboundBuffer(ptr, bytes);
    {
      // Listed before it is posted, so that an abort_waits from here on ends its wait; one
      // that ran before finds the communicator failed, or the pair closed (the post throws).
      std::lock_guard lock(c.live_mutex);
      c.live.insert(state.get());
    }
    if (is_send) {
      state->buffer->send(peer, slot, 0, bytes);
    } else {
      state->buffer->recv(peer, slot, 0, bytes);
    }
  } catch (const std::exception& e) {
    {
      std::lock_guard lock(c.live_mutex);
      c.live.erase(state.get());
    }
    state->done = true;
    if (c.failed.load()) {
      throw TransportError(
          fmt::format("rank {}: {} {} peer {} of '{}' failed: communicator had failed: {}", c.rank,
                      operation, is_send ? "to" : "from", peer, label, c.failure()));
    }
    // The post threw: the pair to peer has failed.
    int cause = peer;
    std::string origin;
    const std::string why = c.closed_by(peer, cause, origin);
    const std::string msg =
        fmt::format("rank {}: {} {} peer {} of '{}' failed: {} [{}]", c.rank, operation,
                    is_send ? "to" : "from", peer, label, why, e.what());
    c.fail(msg, cause, origin.empty() ? msg : origin);
    throw TransportError(msg);
  }
  return Request(std::move(state));
}

Request Communicator::send(int peer, std::uint64_t tag, std::span<const std::byte> data,
                           std::string_view label) {
  impl_->check_peer(peer, "send");
  if (tag > kMaxTag) throw InvalidArgument(fmt::format("send: tag {} above kMaxTag", tag));
  impl_->check_usable();
  // Gloo's unbound buffer takes a non-const pointer for both directions; a send only reads it.
  return impl_->post(true, peer, kUserSlot | tag, tag,
              const_cast<std::byte*>(data.data()), data.size(), label, "send");
}

Request Communicator::recv(int peer, std::uint64_t tag, std::span<std::byte> data,
                           std::string_view label) {
  impl_->check_peer(peer, "recv");
  if (tag > kMaxTag) throw InvalidArgument(fmt::format("recv: tag {} above kMaxTag", tag));
  impl_->check_usable();
  return impl_->post(false, peer, kUserSlot | tag, tag, data.data(), data.size(), label, "recv");
}

void Communicator::allgatherv(std::span<const std::byte> input, std::span<std::byte> output,
                              std::span<const std::size_t> sizes, std::string_view label) {
  Impl& c = *impl_;
  const int n = c.size, r = c.rank;
  if (sizes.size() != static_cast<std::size_t>(n)) {
    throw InvalidArgument(fmt::format("rank {}: allgatherv of '{}': {} sizes for {} ranks", r,
                                      label, sizes.size(), n));
  }
  std::vector<std::size_t> offset(n + 1, 0);
  for (int i = 0; i < n; ++i) offset[i + 1] = offset[i] + sizes[i];
  if (input.size() != sizes[r] || output.size() != offset[n]) {
    throw InvalidArgument(fmt::format(
        "rank {}: allgatherv of '{}': input {} bytes (expected {}), output {} bytes (expected {})",
        r, label, input.size(), sizes[r], output.size(), offset[n]));
  }
  c.check_usable();
  if (!input.empty() && input.data() != output.data() + offset[r]) {
    std::memmove(output.data() + offset[r], input.data(), input.size());
  }
  if (n == 1) return;
  const std::uint64_t seq = c.collective_seq++;
  const int next = (r + 1) % n, prev = (r + n - 1) % n;
  // Ring: at step s, pass on the block received at step s-1 (initially our own).
  for (int s = 0; s < n - 1; ++s) {
    const int send_block = (r - s + n) % n;
    const int recv_block = (r - s - 1 + 2 * n) % n;
    const std::uint64_t slot = kCollectiveSlot | (seq << 16) | static_cast<std::uint64_t>(s);
    Request rx = c.post(false, prev, slot, seq, output.data() + offset[recv_block],
                      sizes[recv_block], label, "allgatherv recv");
    Request tx = c.post(true, next, slot, seq, output.data() + offset[send_block],
                      sizes[send_block], label, "allgatherv send");
    rx.wait();
    tx.wait();
  }
}

void Communicator::broadcast(int root, std::span<std::byte> data, std::string_view label) {
  Impl& c = *impl_;
  if (root < 0 || root >= c.size) {
    throw InvalidArgument(fmt::format("rank {}: broadcast of '{}': bad root {}", c.rank, label, root));
  }
  c.check_usable();
  if (c.size == 1) return;
  const std::uint64_t seq = c.collective_seq++;
  const std::uint64_t slot = kCollectiveSlot | (seq << 16);
  if (c.rank == root) {
    std::vector<Request> sends;
    sends.reserve(c.size - 1);
    for (int p = 0; p < c.size; ++p) {
      if (p != root) {
        sends.push_back(c.post(true, p, slot, seq, data.data(), data.size(), label,
                             "broadcast send"));
      }
    }
    for (auto& s : sends) s.wait();
  } else {
    c.post(false, root, slot, seq, data.data(), data.size(), label, "broadcast recv").wait();
  }
}

void Communicator::barrier(std::string_view label) {
  Impl& c = *impl_;
  c.check_usable();
  if (c.size == 1) return;
  const std::uint64_t seq = c.collective_seq++;
  // Dissemination barrier: ceil(log2 n) rounds of zero-byte messages.
  int round = 0;
  for (int k = 1; k < c.size; k *= 2, ++round) {
    const std::uint64_t slot = kCollectiveSlot | (seq << 16) | static_cast<std::uint64_t>(round);
    Request rx = c.post(false, (c.rank - k + c.size) % c.size, slot, seq, nullptr, 0,
                      label.empty() ? "barrier" : label, "barrier recv");
    Request tx = c.post(true, (c.rank + k) % c.size, slot, seq, nullptr, 0,
                      label.empty() ? "barrier" : label, "barrier send");
    rx.wait();
    tx.wait();
  }
}

void Communicator::abort(std::string_view reason) noexcept {
  std::string msg;
  try {
    msg = fmt::format("rank {}: aborted: {}", impl_->rank, reason);
  } catch (...) {
    msg = "aborted";
  }
  impl_->fail(msg, impl_->rank, msg);
}

bool Communicator::failed() const noexcept { return impl_->failed.load(); }
int Communicator::failed_because_of() const noexcept {
  return impl_->failed.load() ? impl_->failure_cause() : -1;
}
void Communicator::set_peer_places(std::vector<std::string> places) {
  if (!places.empty() && static_cast<int>(places.size()) != impl_->size) {
    throw InvalidArgument(fmt::format("set_peer_places: {} places for {} ranks", places.size(),
                                      impl_->size));
  }
  std::lock_guard lock(impl_->places_mutex);
  impl_->places = std::move(places);
}
int Communicator::rank() const noexcept { return impl_->rank; }
int Communicator::size() const noexcept { return impl_->size; }
milliseconds Communicator::timeout() const noexcept { return impl_->timeout; }
std::string Communicator::address() const { return impl_->address; }

std::shared_ptr<gloo::Context> gloo_context(Communicator& comm) { return comm.impl_->context; }

Communicator::Communicator(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Communicator::~Communicator() = default;

// ---------------------------------------------------------------------------------------------

std::unique_ptr<Communicator> Communicator::create(int rank, int size, std::shared_ptr<Store> store,
                                                   CommunicatorOptions options) {
  if (size < 1 || rank < 0 || rank >= size) {
    throw InvalidArgument(fmt::format("communicator: rank {} is not in 0..{} (size {})", rank,
                                      size - 1, size));
  }
  if (!store) throw InvalidArgument("communicator: no store given");
  auto impl = std::make_unique<Impl>();
  impl->rank = rank;
  impl->size = size;
  impl->timeout = options.timeout.count() > 0 ? options.timeout : default_timeout();
  impl->store = make_prefix_store(options.prefix, std::move(store));

  // Gloo writes to sockets without MSG_NOSIGNAL: a peer that died would kill us with SIGPIPE
  // instead of producing an error. Only replace the default action, never a handler of the host.
  struct sigaction old {};
  if (sigaction(SIGPIPE, nullptr, &old) == 0 && old.sa_handler == SIG_DFL) {
    signal(SIGPIPE, SIG_IGN);
  }

  gloo::transport::tcp::attr attr;
  const std::string& interface = options.interface;
  std::string where;
  try {
    if (!interface.empty()) {
      attr.iface = interface;
      where = "interface " + interface;
    } else {
      attr.hostname = options.hostname;
      where = options.hostname.empty() ? "this host's name" : "host " + options.hostname;
    }
    attr = gloo::transport::tcp::CreateDeviceAttr(attr);
  } catch (const std::exception& e) {
    if (!interface.empty() || !options.hostname.empty()) {
      throw InvalidArgument(fmt::format("rank {}: cannot use {} for Gloo: {}", rank, where,
                                        e.what()));
    }
    // The host name does not resolve to a local address: single-host runs still work.
    gloo::transport::tcp::attr loopback;
    loopback.hostname = "127.0.0.1";
    attr = gloo::transport::tcp::CreateDeviceAttr(loopback);
  }
  impl->address = address_of(attr);
  try {
    transport::BatchScope batch;  // the device's event loop thread inherits SCHED_BATCH
    impl->device = gloo::transport::tcp::CreateDevice(attr);
  } catch (const std::exception& e) {
    throw TransportError(
        fmt::format("rank {}: cannot create Gloo device on {}: {}", rank, impl->address, e.what()));
  }
  impl->context = std::make_shared<gloo::rendezvous::Context>(rank, size);
  impl->context->setTimeout(impl->timeout);
  GlooStore gloo_store(impl->store, impl->timeout);
  const auto prefix = [&] {
    return fmt::format("rank {} ({}): connecting to {} other ranks", rank, impl->address,
                       size - 1);
  };
  try {
    impl->context->connectFullMesh(gloo_store, impl->device);
  } catch (const TimeoutError& e) {
    throw TimeoutError(fmt::format("{}: {}", prefix(), e.what()));
  } catch (const Error& e) {
    throw TransportError(fmt::format("{}: {}", prefix(), e.what()));
  } catch (const std::exception& e) {
    if (contains(e.what(), "imeout")) throw TimeoutError(fmt::format("{}: {}", prefix(), e.what()));
    throw TransportError(fmt::format("{}: {}", prefix(), e.what()));
  }
  impl->start_watchdog();
  if (size > 1) impl->authenticate_peers(options.secret);
  std::unique_ptr<Communicator> comm(new Communicator(std::move(impl)));
  comm->barrier("bootstrap");
  return comm;
}

namespace {

// Stores made from the environment, by where they come from ("tcp HOST:PORT server", ...), and
// how many communicators from_env has made with each prefix. Rank 0's TCP store serves
// MASTER_PORT: a second server could not bind it while the first lives, and one that went away
// with its last communicator could leave a peer's next bootstrap talking to it, so the stores
// live as long as the process (never destroyed: no thread is joined at exit).
struct EnvStores {
  std::mutex mutex;
  std::map<std::string, std::shared_ptr<Store>> stores;
  std::map<std::string, std::string> secrets;  // what each TCP store was made with
  std::map<std::string, int> from_env_calls;  // by options.prefix
};

EnvStores& env_stores() {
  static EnvStores* const stores = new EnvStores();
  return *stores;
}

}  // namespace

Bootstrap bootstrap_from_env(milliseconds timeout, const std::string& secret) {
  auto integer = [](const char* name, bool required, int fallback) {
    const std::string v = env(name);
    if (v.empty()) {
      if (required) throw InvalidArgument(fmt::format("environment variable {} is not set", name));
      return fallback;
    }
    char* end = nullptr;
    long x = std::strtol(v.c_str(), &end, 10);
    if (end == v.c_str() || *end != '\0' || x < 0 || x > 1 << 30) {
      throw InvalidArgument(fmt::format("environment variable {}='{}' is not a valid number", name, v));
    }
    return static_cast<int>(x);
  };
  Bootstrap b;
  b.rank = integer("RANK", true, 0);
  b.size = integer("WORLD_SIZE", true, 1);
  const std::string dir = env("TERSE_FILE_STORE");
  std::string addr;
  int port = 0;
  if (dir.empty()) {
    addr = env("MASTER_ADDR");
    if (addr.empty()) {
      throw InvalidArgument(
          "environment: set MASTER_ADDR and MASTER_PORT (torchrun does), or TERSE_FILE_STORE");
    }
    port = integer("MASTER_PORT", true, 0);
  }
  // TERSE_STORE_SERVED=1: the launcher serves the store (terse run --elastic), so that it
  // outlives every rank; rank 0 is a client like the others.
  const bool serve = b.rank == 0 && env("TERSE_STORE_SERVED") != "1";
  const std::string where =
      !dir.empty() ? "file " + dir
                   : fmt::format("tcp {}:{} {}", addr, port, serve ? "server" : "client");
  EnvStores& cache = env_stores();
  std::lock_guard lock(cache.mutex);
  std::shared_ptr<Store>& store = cache.stores[where];
  if (!store) {
    store = !dir.empty() ? make_file_store(dir)
                         : make_tcp_store(addr, port, serve, timeout, secret);
    cache.secrets[where] = secret;
  } else if (dir.empty() && cache.secrets[where] != secret) {
    // The one store per address cannot change its secret (its server holds MASTER_PORT).
    throw InvalidArgument(fmt::format(
        "rank {}: the store {} was made earlier in this process {} job secret; a later "
        "bootstrap must use the same one",
        b.rank, where, cache.secrets[where].empty() ? "without a" : "with another"));
  }
  b.store = store;
  return b;
}

std::unique_ptr<Communicator> Communicator::from_env(CommunicatorOptions options) {
  if (options.timeout.count() <= 0) options.timeout = default_timeout();
  Bootstrap b = bootstrap_from_env(options.timeout, options.secret);
  {
    // The store outlives communicators and keeps their keys: the n-th communicator of a prefix
    // meets the other ranks' n-th under a prefix of its own.
    EnvStores& cache = env_stores();
    std::lock_guard lock(cache.mutex);
    const int n = ++cache.from_env_calls[options.prefix];
    if (n > 1) options.prefix = fmt::format("{}/{}", options.prefix, n);
  }
  return create(b.rank, b.size, std::move(b.store), std::move(options));
}

}  // namespace terse
