// Communicator's failure handling: failure notices to the peers, and the watchdog that ends the
// waits on a pair that closed (communicator_impl.h says why Gloo needs it).
#include <algorithm>
#include <cstring>

#include "transport/communicator_impl.h"
#include "transport/scheduling.h"

namespace terse {

using namespace transport;

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
    return fmt::format("peer {} closed the connection (it exited, crashed or failed){}", peer,
                       place_of(peer));
  }
  cause = c;
  origin.assign(notice_in[peer].data() + 8, n);
  if (c == peer) return fmt::format("peer {} aborted{}: {}", peer, place_of(peer), origin);
  return fmt::format("peer {} aborted because of rank {}{}: {}", peer, c, place_of(c), origin);
}

std::string Communicator::Impl::place_of(int r) const {
  std::lock_guard lock(places_mutex);
  if (r < 0 || r >= static_cast<int>(places.size()) || places[r].empty()) return {};
  return fmt::format(" (rank {} is on {})", r, places[r]);
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

}  // namespace terse
