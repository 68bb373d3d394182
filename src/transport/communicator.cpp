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
#include "transport/scheduling.h"

namespace terse {

using std::chrono::milliseconds;
using Clock = std::chrono::steady_clock;

namespace {

// Slot layout: the top byte separates terse's users, its own collectives, the abort probe, the
// watchdog's sentinels and failure notices from Gloo's algorithms (prefixes 0x01..0x08), the low
// 56 bits carry the tag. Nobody sends to the abort or watch slots.
constexpr std::uint64_t kUserSlot = std::uint64_t{0x40} << 56;
constexpr std::uint64_t kCollectiveSlot = std::uint64_t{0x41} << 56;
constexpr std::uint64_t kAbortSlot = std::uint64_t{0x42} << 56;
constexpr std::uint64_t kWatchSlot = std::uint64_t{0x43} << 56;
constexpr std::uint64_t kNoticeSlot = std::uint64_t{0x44} << 56;

// A failure notice: i32 the rank whose failure started it, u32 length, the first message about
// that failure (truncated to fit).
constexpr std::size_t kNoticeBytes = 1024;
// How long a failing rank lets its notices leave before it closes its connections; a peer that
// does not read meanwhile (stalled) gets none.
constexpr milliseconds kNoticeGrace{500};

// A wait that must not time out (a Gloo wait that times out closes every connection).
constexpr milliseconds kForever = std::chrono::hours(24 * 365);

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

milliseconds default_timeout() { return std::chrono::seconds(60); }

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

  // Requests posted and not yet waited for. Gloo tells a pair's error to the operations still
  // queued on the pair, but not to an unbound-buffer send or recv whose bytes are already
  // moving: that wait would sit out the whole timeout after the peer died. So the communicator
  // keeps its own list and ends those waits itself: every one when it fails (fail), and those
  // on a pair that failed (the watchdog). Guarded by live_mutex, which also orders a request's
  // abort before its destruction.
  std::mutex live_mutex;
  std::unordered_set<Request::State*> live;

  // The watchdog learns of a failed pair without polling: a zero-byte recv that nobody sends
  // to is posted to every peer on one buffer (all_sentinel), and Gloo signals it when any pair
  // fails. One such recv per peer (peer_sentinel) tells which pair it was. Gloo cannot say
  // whether an operation completed before its pair closed without waiting for it, so the
  // watchdog ends a wait on a closed pair only once it has lasted kCloseGrace past the close:
  // a completed operation's wait returns at once.
  static constexpr milliseconds kClosePoll{50};
  static constexpr milliseconds kCloseGrace{200};
  std::thread watchdog;
  std::condition_variable watch_cv;  // wakes the watchdog's polls to stop
  bool stopping = false;                                         // under live_mutex
  std::unique_ptr<gloo::transport::UnboundBuffer> all_sentinel;  // under live_mutex
  std::vector<std::unique_ptr<gloo::transport::UnboundBuffer>> peer_sentinel;
  std::vector<Clock::time_point> closed_at;  // per peer, when the watchdog saw its pair fail
  std::vector<std::string> closed_error;     // and Gloo's error; both under live_mutex

  // Failure notices. A rank that fails tells every peer, before it closes its connections, which
  // rank's failure it follows and the first message about it, so that a peer whose connection
  // to it then closes names that rank rather than blaming one that is alive. Each peer's notice
  // lands in notice_in[peer] (a recv posted for the communicator's life); bytes that precede a
  // close on the same connection are read before it, so once a pair has failed its notice is
  // there or was never sent. notice_out is written once, by the first fail().
  std::vector<std::vector<char>> notice_in;
  std::vector<std::unique_ptr<gloo::transport::UnboundBuffer>> notice_recv;
  std::vector<char> notice_out;
  std::unique_ptr<gloo::transport::UnboundBuffer> notice_send;

  ~Impl() { stop_watchdog(); }

  std::string failure() {
    std::lock_guard lock(fail_mutex);
    return first_error;
  }

  // Records the first error, tells the peers that this rank fails because of rank `cause`
  // (origin: the first message about that failure) and closes every connection, so that waits
  // in other threads here and on peers blocked on this rank end now rather than at their
  // timeouts.
  void fail(const std::string& reason, int cause, const std::string& origin) noexcept {
    {
      std::lock_guard lock(fail_mutex);
      if (failed.exchange(true)) return;
      first_error = reason;
    }
    if (!context || size == 1) return;
    send_notices(cause, origin);
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
    // Every pair is closed, so Gloo touches no buffer any more: end every wait now.
    abort_waits();
  }

  void post_notice_recvs();
  // Sends the failure notice to every peer whose pair is open and waits, up to kNoticeGrace, for
  // the sends to complete. Called once, by the first fail().
  void send_notices(int cause, const std::string& origin) noexcept;
  // Why peer's connection closed, for an error message: its notice if it sent one ("peer P
  // aborted because of rank C: ..."), else that it closed. Sets cause and origin to what this
  // rank's own failure then follows (origin empty: this message is the first about it). Only for
  // a peer whose pair has failed (its notice buffer is written no more).
  std::string closed_by(int peer, int& cause, std::string& origin) const;

  // Ends the wait of every live request (Request::wait then throws TransportError).
  void abort_waits();
  // Ends s's wait, recording Gloo's error for its pair (empty: the communicator failed).
  // Under live_mutex.
  static void abort_wait(Request::State& s, const std::string& gloo_error);

  void start_watchdog();
  // Posts a fresh all_sentinel to every peer whose pair is not known closed. Returns false if
  // a post threw (that pair failed meanwhile). Under live_mutex once the watchdog runs.
  bool post_all_sentinel();
  void stop_watchdog();
  void watch();
  // Records the pairs found failed since the last call (peer sentinels polled without
  // blocking). Returns true if a pair is still open.
  bool find_closed_pairs();
  // Ends the waits that have lasted kCloseGrace on a closed pair. Returns true while a request
  // on a closed pair is left (not waited for yet, or within the grace). Under live_mutex.
  bool end_stuck_waits();

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
  // Under the communicator's live_mutex: when wait() began waiting (epoch while not waiting),
  // and whether abort_waits ended the wait, with Gloo's error for this request's pair (empty
  // when the whole communicator failed).
  Clock::time_point waiting_since{};
  bool aborted = false;
  std::string abort_error;

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
        "{} timed out after {} ms: peer {} stalled, died, or did not post the matching {}",
        s.describe(), timeout.count(), s.peer, s.is_send ? "recv" : "send");
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

// ---------------------------------------------------------------------------------------------

void Communicator::Impl::abort_wait(Request::State& s, const std::string& gloo_error) {
  s.aborted = true;
  s.abort_error = gloo_error;
  if (s.is_send) {
    s.buffer->abortWaitSend();
  } else {
    s.buffer->abortWaitRecv();
  }
}

void Communicator::Impl::post_notice_recvs() {
  notice_in.assign(size, std::vector<char>());
  notice_recv.resize(size);
  for (int p = 0; p < size; ++p) {
    if (p == rank) continue;
    notice_in[p].assign(kNoticeBytes, 0);
    notice_recv[p] = context->createUnboundBuffer(notice_in[p].data(), kNoticeBytes);
    notice_recv[p]->recv(p, kNoticeSlot, 0, kNoticeBytes);
  }
}

void Communicator::Impl::send_notices(int cause, const std::string& origin) noexcept {
  try {
    const std::uint32_t n = static_cast<std::uint32_t>(std::min(origin.size(), kNoticeBytes - 8));
    const std::int32_t c = cause;
    notice_out.assign(8 + n, 0);
    std::memcpy(notice_out.data(), &c, 4);
    std::memcpy(notice_out.data() + 4, &n, 4);
    std::memcpy(notice_out.data() + 8, origin.data(), n);
    notice_send = context->createUnboundBuffer(notice_out.data(), notice_out.size());
    int posted = 0;
    for (int p = 0; p < size; ++p) {
      if (p == rank) continue;
      {
        std::lock_guard lock(live_mutex);
        if (!closed_at.empty() && closed_at[p] != Clock::time_point{}) continue;
      }
      try {
        notice_send->send(p, kNoticeSlot, 0, notice_out.size());
        ++posted;
      } catch (const std::exception&) {
        // That pair has failed: nobody to tell.
      }
    }
    // A wait that runs out closes every pair, which the caller is about to do anyway.
    const auto deadline = Clock::now() + kNoticeGrace;
    for (int k = 0; k < posted; ++k) {
      const auto left = std::chrono::duration_cast<milliseconds>(deadline - Clock::now());
      if (left <= milliseconds(0) || !notice_send->waitSend(nullptr, left)) break;
    }
  } catch (const std::exception&) {
    // Notices only improve the peers' messages.
  }
}

std::string Communicator::Impl::closed_by(int peer, int& cause, std::string& origin) const {
  cause = peer;
  origin.clear();
  std::int32_t c = -1;
  std::uint32_t n = 0;
  if (peer >= 0 && peer < static_cast<int>(notice_in.size()) && !notice_in[peer].empty()) {
    std::memcpy(&c, notice_in[peer].data(), 4);
    std::memcpy(&n, notice_in[peer].data() + 4, 4);
  }
  if (n == 0 || n > kNoticeBytes - 8 || c < 0 || c >= size) {
    return fmt::format("peer {} closed the connection (it exited, crashed or failed)", peer);
  }
  cause = c;
  origin.assign(notice_in[peer].data() + 8, n);
  if (c == peer) return fmt::format("peer {} aborted: {}", peer, origin);
  return fmt::format("peer {} aborted because of rank {}: {}", peer, c, origin);
}

void Communicator::Impl::abort_waits() {
  std::lock_guard lock(live_mutex);
  for (Request::State* s : live) {
    if (!s->aborted) abort_wait(*s, {});
  }
}

bool Communicator::Impl::post_all_sentinel() {
  all_sentinel = context->createUnboundBuffer(nullptr, 0);
  bool posted = true;
  for (int p = 0; p < size; ++p) {
    if (p == rank || closed_at[p] != Clock::time_point{}) continue;
    try {
      all_sentinel->recv(p, kWatchSlot, 0, 0);
    } catch (const std::exception&) {
      posted = false;
    }
  }
  return posted;
}

void Communicator::Impl::start_watchdog() {
  if (size == 1) return;
  post_notice_recvs();
  closed_at.assign(size, Clock::time_point{});
  closed_error.assign(size, std::string());
  peer_sentinel.resize(size);
  for (int p = 0; p < size; ++p) {
    if (p == rank) continue;
    peer_sentinel[p] = context->createUnboundBuffer(nullptr, 0);
    peer_sentinel[p]->recv(p, kWatchSlot, 0, 0);
  }
  post_all_sentinel();  // a pair failed already would have made a peer sentinel's post throw
  watchdog = std::thread([this] {
    transport::enter_batch_scheduling();
    watch();
  });
}

void Communicator::Impl::stop_watchdog() {
  if (!watchdog.joinable()) return;
  {
    std::lock_guard lock(live_mutex);
    stopping = true;
    // Sticky: also ends a wait that has not begun yet.
    if (all_sentinel) all_sentinel->abortWaitRecv();
  }
  watch_cv.notify_all();
  watchdog.join();
}

bool Communicator::Impl::find_closed_pairs() {
  std::vector<std::pair<int, std::string>> found;
  bool open = false;
  for (int p = 0; p < size; ++p) {
    if (p == rank) continue;
    {
      std::lock_guard lock(live_mutex);
      if (closed_at[p] != Clock::time_point{}) continue;
    }
    // With an abort pending, a wait returns false at once, or throws the pair's error.
    peer_sentinel[p]->abortWaitRecv();
    try {
      peer_sentinel[p]->waitRecv(nullptr, milliseconds(0));
      open = true;
    } catch (const std::exception& e) {
      found.emplace_back(p, e.what());
    }
  }
  std::lock_guard lock(live_mutex);
  for (auto& [p, error] : found) {
    closed_at[p] = Clock::now();
    closed_error[p] = std::move(error);
  }
  return open;
}

bool Communicator::Impl::end_stuck_waits() {
  const auto now = Clock::now();
  bool left = false;
  for (Request::State* s : live) {
    const Clock::time_point closed = closed_at[s->peer];
    if (s->aborted || closed == Clock::time_point{}) continue;
    // A timeout of our own closes every pair and fails the communicator, which ends every
    // wait with the real cause; do not race it with Gloo's echo of it.
    if (contains(closed_error[s->peer], "Application timeout")) continue;
    if (s->waiting_since == Clock::time_point{} ||
        now - std::max(s->waiting_since, closed) < kCloseGrace) {
      left = true;
      continue;
    }
    abort_wait(*s, closed_error[s->peer]);
  }
  return left;
}

void Communicator::Impl::watch() {
  try {
    bool pairs_failed = false;
    for (;;) {
      if (!pairs_failed) {
        gloo::transport::UnboundBuffer* sentinel = nullptr;
        {
          std::lock_guard lock(live_mutex);
          if (stopping) return;
          sentinel = all_sentinel.get();
        }
        try {
          if (!sentinel->waitRecv(nullptr, kForever)) continue;  // aborted: stopping
        } catch (const std::exception&) {
          // Some pair failed.
        }
      }
      // Until no request on a closed pair is left: poll for more closed pairs, end the waits
      // that are stuck.
      bool open = true;
      for (;;) {
        open = find_closed_pairs();
        std::unique_lock lock(live_mutex);
        if (stopping) return;
        if (failed.load() || !end_stuck_waits()) break;
        watch_cv.wait_for(lock, kClosePoll);
      }
      std::unique_lock lock(live_mutex);
      if (!open || failed.load()) {
        // Nothing left to watch: every pair is closed, or fail() closed them and ended every
        // wait (and will end any later one).
        all_sentinel.reset();
        watch_cv.wait(lock, [this] { return stopping; });
        return;
      }
      // The old sentinel keeps its error: watch the pairs still open with a fresh one. A post
      // that throws means that pair failed meanwhile: go round again without blocking.
      pairs_failed = !post_all_sentinel();
    }
  } catch (const std::exception&) {
    // The watchdog only shortens waits; without it a wait still ends at its timeout.
  }
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
  std::map<std::string, int> from_env_calls;  // by options.prefix
};

EnvStores& env_stores() {
  static EnvStores* const stores = new EnvStores();
  return *stores;
}

}  // namespace

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
  const std::string where =
      !dir.empty() ? "file " + dir
                   : fmt::format("tcp {}:{} {}", addr, port, b.rank == 0 ? "server" : "client");
  EnvStores& cache = env_stores();
  std::lock_guard lock(cache.mutex);
  std::shared_ptr<Store>& store = cache.stores[where];
  if (!store) {
    store = !dir.empty() ? make_file_store(dir) : make_tcp_store(addr, port, b.rank == 0, timeout);
  }
  b.store = store;
  return b;
}

std::unique_ptr<Communicator> Communicator::from_env(CommunicatorOptions options) {
  if (options.timeout.count() <= 0) options.timeout = default_timeout();
  Bootstrap b = bootstrap_from_env(options.timeout);
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
