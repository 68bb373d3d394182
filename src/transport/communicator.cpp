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

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <numeric>

#include "terse/error.h"

namespace terse {

using std::chrono::milliseconds;
using Clock = std::chrono::steady_clock;

namespace {

// Slot layout: the top byte separates terse's users, its own collectives and the abort probe
// from Gloo's algorithms (prefixes 0x01..0x08), the low 56 bits carry the tag.
constexpr std::uint64_t kUserSlot = std::uint64_t{0x40} << 56;
constexpr std::uint64_t kCollectiveSlot = std::uint64_t{0x41} << 56;
constexpr std::uint64_t kAbortSlot = std::uint64_t{0x42} << 56;

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

bool contains(std::string_view s, std::string_view what) {
  return s.find(what) != std::string_view::npos;
}

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

milliseconds default_timeout() {
  const std::string v = env("TERSE_TIMEOUT");
  if (!v.empty()) {
    char* end = nullptr;
    double s = std::strtod(v.c_str(), &end);
    if (end == v.c_str() || *end != '\0' || !(s > 0) || s > 1e7) {
      throw InvalidArgument(fmt::format("TERSE_TIMEOUT='{}' is not a positive number of seconds", v));
    }
    return milliseconds(static_cast<std::int64_t>(s * 1000 + 0.5));
  }
  return std::chrono::seconds(60);
}

struct Communicator::Impl {
  int rank = 0;
  int size = 1;
  milliseconds timeout{60000};
  std::string address;
  std::shared_ptr<Store> store;
  // Declared before the context so that it is destroyed after it.
  std::shared_ptr<gloo::transport::Device> device;
  std::shared_ptr<gloo::rendezvous::Context> context;

  std::atomic<bool> failed{false};
  std::mutex fail_mutex;
  std::string first_error;
  std::uint32_t collective_seq = 0;
  char abort_byte = 0;

  std::string failure() {
    std::lock_guard lock(fail_mutex);
    return first_error;
  }

  // Records the first error and closes every connection, so that waits in other threads here
  // and on peers blocked on this rank end now rather than at their timeouts.
  void fail(const std::string& reason) noexcept {
    {
      std::lock_guard lock(fail_mutex);
      if (failed.exchange(true)) return;
      first_error = reason;
    }
    if (!context || size == 1) return;
    // Gloo's public API has one way to fail a whole context: an unbound-buffer wait that times
    // out signals every pair. Probe with a zero timeout on a slot nobody sends to.
    for (int peer = 0; peer < size; ++peer) {
      if (peer == rank) continue;
      try {
        auto probe = context->createUnboundBuffer(&abort_byte, 1);
        probe->recv(peer, kAbortSlot);
        probe->waitRecv(nullptr, milliseconds(0));
      } catch (const std::exception& e) {
        if (contains(e.what(), "Timed out")) break;  // every pair is now closed
      }
    }
  }

  // Posts one unbound-buffer operation; on failure fails the communicator and throws.
  Request post(bool is_send, int peer, std::uint64_t slot, std::uint64_t tag, void* ptr,
               std::size_t bytes, std::string_view label, const char* operation);

  void check_usable() {
    if (failed.load()) {
      throw TransportError(
          fmt::format("rank {}: communicator has failed: {}", rank, failure()));
    }
  }

  void check_peer(int peer, const char* what) const {
    if (peer < 0 || peer >= size || peer == rank) {
      throw InvalidArgument(fmt::format("rank {}: {}: peer {} is not another rank of 0..{}",
                                        rank, what, peer, size - 1));
    }
  }
};

// ---------------------------------------------------------------------------------------------

struct Request::State {
  Communicator::Impl* comm = nullptr;
  std::unique_ptr<gloo::transport::UnboundBuffer> buffer;
  bool is_send = false;
  bool done = false;
  int peer = 0;
  std::uint64_t tag = 0;
  const char* operation = "";  // "send", "recv", "allgatherv", ...
  std::string label;

  std::string describe() const {
    return fmt::format("rank {}: {} {} peer {} of '{}' (tag {}, {} bytes)", comm->rank,
                       operation, is_send ? "to" : "from", peer,
                       label.empty() ? "(unnamed)" : label, tag, buffer->size);
  }
};

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
  try {
    ok = s.is_send ? s.buffer->waitSend(nullptr, timeout) : s.buffer->waitRecv(nullptr, timeout);
  } catch (const std::exception& e) {
    gloo_message = e.what();
  }
  if (ok) return;
  if (gloo_message.empty()) gloo_message = "wait aborted";
  // Tell apart: this communicator failed earlier (our abort closed the pairs), a timeout here,
  // and a peer that closed its connection.
  if (failed_before || (s.comm->failed.load() && contains(gloo_message, "Application timeout"))) {
    throw TransportError(fmt::format("{} failed because the communicator had failed: {}",
                                     s.describe(), s.comm->failure()));
  }
  std::string msg;
  if (contains(gloo_message, "Timed out")) {
    msg = fmt::format(
        "{} timed out after {} ms: peer {} stalled, died, or did not post the matching {}",
        s.describe(), timeout.count(), s.peer, s.is_send ? "recv" : "send");
    s.comm->fail(msg);
    throw TimeoutError(msg);
  }
  if (contains(gloo_message, "closed by peer") || contains(gloo_message, "Connection reset") ||
      contains(gloo_message, "Read error") || contains(gloo_message, "writev")) {
    msg = fmt::format("{} failed: peer {} closed the connection (it exited, crashed or failed) "
                      "[{}]",
                      s.describe(), s.peer, gloo_message);
  } else {
    msg = fmt::format("{} failed: {}", s.describe(), gloo_message);
  }
  s.comm->fail(msg);
  throw TransportError(msg);
}

// ---------------------------------------------------------------------------------------------

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
    if (is_send) {
      state->buffer->send(peer, slot, 0, bytes);
    } else {
      state->buffer->recv(peer, slot, 0, bytes);
    }
  } catch (const std::exception& e) {
    state->done = true;
    std::string msg =
        c.failed.load()
            ? fmt::format("rank {}: {} {} peer {} of '{}' failed: communicator had failed: {}",
                          c.rank, operation, is_send ? "to" : "from", peer, label, c.failure())
            : fmt::format("rank {}: {} {} peer {} of '{}' failed: peer {} closed the connection "
                          "or the communicator failed [{}]",
                          c.rank, operation, is_send ? "to" : "from", peer, label, peer,
                          e.what());
    c.fail(msg);
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
  impl_->fail(fmt::format("rank {}: aborted: {}", impl_->rank, reason));
}

bool Communicator::failed() const noexcept { return impl_->failed.load(); }
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
  std::string interface = options.interface;
  if (interface.empty()) interface = env("TERSE_IFNAME");
  if (interface.empty()) interface = env("GLOO_SOCKET_IFNAME");
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
  std::unique_ptr<Communicator> comm(new Communicator(std::move(impl)));
  comm->barrier("bootstrap");
  return comm;
}

Bootstrap bootstrap_from_env(milliseconds timeout) {
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
  if (!dir.empty()) {
    b.store = make_file_store(dir);
  } else {
    const std::string addr = env("MASTER_ADDR");
    if (addr.empty()) {
      throw InvalidArgument(
          "environment: set MASTER_ADDR and MASTER_PORT (torchrun does), or TERSE_FILE_STORE");
    }
    const int port = integer("MASTER_PORT", true, 0);
    b.store = make_tcp_store(addr, port, b.rank == 0, timeout);
  }
  return b;
}

std::unique_ptr<Communicator> Communicator::from_env(CommunicatorOptions options) {
  if (options.timeout.count() <= 0) options.timeout = default_timeout();
  Bootstrap b = bootstrap_from_env(options.timeout);
  return create(b.rank, b.size, std::move(b.store), std::move(options));
}

}  // namespace terse
