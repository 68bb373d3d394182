#include "kit/memory.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <deque>
#include <mutex>
#include <new>
#include <vector>

namespace terse::kit {

namespace {

#if defined(__SANITIZE_ADDRESS__)
constexpr bool kRetain = false;
#else
constexpr bool kRetain = true;
#endif

// aligned_alloc's size for a request: a multiple of the alignment.
std::size_t rounded(std::size_t bytes) {
  bytes = std::max<std::size_t>(bytes, 1);
  const std::size_t align = bytes >= kHugePage ? kHugePage : 64;
  return (bytes + align - 1) / align * align;
}

std::size_t budget_from_env() {
  if (const char* v = std::getenv("TERSE_RETAIN_MB"); v != nullptr && *v != '\0') {
    char* end = nullptr;
    const unsigned long long mb = std::strtoull(v, &end, 10);
    if (end != v && *end == '\0') return static_cast<std::size_t>(mb) << 20;
  }
  const long pages = ::sysconf(_SC_PHYS_PAGES), page = ::sysconf(_SC_PAGESIZE);
  const std::size_t memory =
      pages > 0 && page > 0 ? static_cast<std::size_t>(pages) * static_cast<std::size_t>(page) : 0;
  return std::min<std::size_t>(std::size_t{1} << 30, memory / 16);
}

// The freed large blocks kept for reuse, oldest first.
class Retained {
 public:
  using Clock = std::chrono::steady_clock;
  static constexpr auto kMaxAge = std::chrono::seconds(60);

  // A kept block of exactly `size` bytes, or null.
  std::byte* take(std::size_t size) {
    std::vector<std::byte*> old;  // freed outside the lock
    std::byte* p = nullptr;
    {
      std::lock_guard lock(mu_);
      expire(Clock::now(), old);
      for (auto it = kept_.rbegin(); it != kept_.rend(); ++it) {  // the newest: the warmest
        if (it->size == size) {
          p = it->data;
          held_ -= size;
          kept_.erase(std::next(it).base());
          break;
        }
      }
    }
    for (std::byte* q : old) std::free(q);
    return p;
  }

  // Keeps p (size bytes) if it fits the budget, freeing older blocks to make room; frees it
  // otherwise.
  void give(std::byte* p, std::size_t size) noexcept {
    std::vector<std::byte*> old;
    bool kept = false;
    {
      std::lock_guard lock(mu_);
      const Clock::time_point now = Clock::now();
      try {
        old.reserve(kept_.size() + 1);
        expire(now, old);
        if (size <= budget_) {
          while (held_ + size > budget_) {
            old.push_back(kept_.front().data);
            held_ -= kept_.front().size;
            kept_.pop_front();
          }
          kept_.push_back({p, size, now});
          held_ += size;
          kept = true;
        }
      } catch (...) {  // no memory for the lists: free it
      }
    }
    for (std::byte* q : old) std::free(q);
    if (!kept) std::free(p);
  }

  std::size_t held() {
    std::lock_guard lock(mu_);
    return held_;
  }
  std::size_t budget() const { return budget_; }

  void clear() {
    std::vector<std::byte*> old;
    {
      std::lock_guard lock(mu_);
      for (const Block& b : kept_) old.push_back(b.data);
      kept_.clear();
      held_ = 0;
    }
    for (std::byte* q : old) std::free(q);
  }

 private:
  struct Block {
    std::byte* data;
    std::size_t size;
    Clock::time_point since;
  };
  // Moves the blocks kept longer than kMaxAge to `out` (mu_ held; out has room reserved or may
  // grow).
  void expire(Clock::time_point now, std::vector<std::byte*>& out) {
    while (!kept_.empty() && now - kept_.front().since > kMaxAge) {
      out.push_back(kept_.front().data);
      held_ -= kept_.front().size;
      kept_.pop_front();
    }
  }

  std::mutex mu_;
  std::deque<Block> kept_;
  std::size_t held_ = 0;
  const std::size_t budget_ = budget_from_env();
};

// Never destroyed: blocks may be freed by other static objects' destructors at exit.
Retained& retained() {
  static Retained* r = new Retained;
  return *r;
}

}  // namespace

void FreeBytes::operator()(std::byte* p) const noexcept {
  if (p == nullptr) return;
  if (kRetain && bytes >= kHugePage) {
    retained().give(p, rounded(bytes));
  } else {
    std::free(p);
  }
}

Bytes allocate_bytes(std::size_t bytes) {
  bytes = std::max<std::size_t>(bytes, 1);
  const bool huge = bytes >= kHugePage;
  const std::size_t size = rounded(bytes);
  if (kRetain && huge) {
    if (std::byte* p = retained().take(size)) return Bytes(p, FreeBytes{bytes});
  }
  auto* p = static_cast<std::byte*>(std::aligned_alloc(huge ? kHugePage : 64, size));
  if (p == nullptr) throw std::bad_alloc();
  // Advice only: where the kernel offers no huge pages, the memory is the same, in 4 KiB pages.
  if (huge) ::madvise(p, size, MADV_HUGEPAGE);
  return Bytes(p, FreeBytes{bytes});
}

std::size_t retained_bytes() { return kRetain ? retained().held() : 0; }
std::size_t retained_budget() { return kRetain ? retained().budget() : 0; }
void release_retained() {
  if (kRetain) retained().clear();
}

}  // namespace terse::kit
