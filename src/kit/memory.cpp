#include "kit/memory.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
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

std::size_t default_budget() {
  const long pages = ::sysconf(_SC_PHYS_PAGES), page = ::sysconf(_SC_PAGESIZE);
  const std::size_t memory =
      pages > 0 && page > 0 ? static_cast<std::size_t>(pages) * static_cast<std::size_t>(page) : 0;
  return std::min<std::size_t>(std::size_t{1} << 30, memory / 16);
}

// Fresh mapped memory of `size` bytes (a multiple of kHugePage), 2 MiB-aligned and advised as
// huge pages; null when the kernel has none to give.
std::byte* map_fresh(std::size_t size) {
  // Over-map by one huge page, then unmap what lies outside the aligned range.
  void* raw = ::mmap(nullptr, size + kHugePage, PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (raw == MAP_FAILED) return nullptr;
  const auto begin = reinterpret_cast<std::uintptr_t>(raw);
  const std::uintptr_t aligned = (begin + kHugePage - 1) / kHugePage * kHugePage;
  if (aligned > begin) ::munmap(raw, aligned - begin);
  const std::uintptr_t tail = begin + kHugePage - aligned;  // what lies past aligned + size
  if (tail > 0) ::munmap(reinterpret_cast<void*>(aligned + size), tail);
  auto* p = reinterpret_cast<std::byte*>(aligned);
  // Advice only: where the kernel offers no huge pages, the memory is the same, in 4 KiB pages.
  ::madvise(p, size, MADV_HUGEPAGE);
  return p;
}

// The freed large blocks kept for reuse, oldest first: mapped ranges of whole huge pages,
// whatever the sizes asked for. A request is served, in this order, by a kept range of its
// size; by the head of the smallest larger one (the rest stays kept); or by fresh mapped
// memory into which kept ranges are moved, newest first, until it is covered or none is left
// (mremap moves a range's page tables: its pages, already backed, come along untouched, and a
// huge page stays one). A job that changes its partition counts (the planner exploring K, a
// benchmark) thus reuses the memory that the last configuration freed, in other sizes.
class Retained {
 public:
  using Clock = std::chrono::steady_clock;
  static constexpr auto kMaxAge = std::chrono::seconds(60);

  // A block of `size` bytes (a multiple of kHugePage), from kept memory as far as it goes;
  // null when even fresh memory cannot be mapped.
  std::byte* take(std::size_t size) {
    std::vector<Range> old;    // unmapped outside the lock
    std::vector<Range> moved;  // kept ranges to move into fresh memory
    std::byte* p = nullptr;
    {
      std::lock_guard lock(mu_);
      expire(Clock::now(), old);
      // The smallest kept range that holds it (the newest of those), else every range newest
      // first until the size is covered.
      auto fit = kept_.end();
      for (auto it = kept_.begin(); it != kept_.end(); ++it) {
        if (it->size >= size && (fit == kept_.end() || it->size <= fit->size)) fit = it;
      }
      if (fit != kept_.end()) {
        p = fit->data;
        held_ -= size;
        if (fit->size == size) {
          kept_.erase(fit);
        } else {
          fit->data += size;
          fit->size -= size;
        }
      } else {
        std::size_t covered = 0;
        while (!kept_.empty() && covered < size) {
          Range r = kept_.back();
          kept_.pop_back();
          const std::size_t part = std::min(r.size, size - covered);
          moved.push_back({r.data, part, r.since});
          if (part < r.size) {  // the rest stays kept, at its place in the order
            kept_.push_back({r.data + part, r.size - part, r.since});
          }
          held_ -= part;
          covered += part;
        }
      }
    }
    for (const Range& r : old) ::munmap(r.data, r.size);
    if (p != nullptr) return p;
    p = map_fresh(size);
    if (p == nullptr) {  // nothing mapped to move into: the moved ranges go
      for (const Range& r : moved) ::munmap(r.data, r.size);
      return nullptr;
    }
    std::size_t offset = 0;
    for (const Range& r : moved) {
      void* to = ::mremap(r.data, r.size, r.size, MREMAP_MAYMOVE | MREMAP_FIXED, p + offset);
      if (to == MAP_FAILED) ::munmap(r.data, r.size);  // that part stays fresh memory
      offset += r.size;
    }
    return p;
  }

  // Keeps p (size bytes) if it fits the budget, unmapping older ranges to make room; unmaps it
  // otherwise.
  void give(std::byte* p, std::size_t size) noexcept {
    std::vector<Range> old;
    bool kept = false;
    {
      std::lock_guard lock(mu_);
      const Clock::time_point now = Clock::now();
      try {
        old.reserve(kept_.size() + 1);
        expire(now, old);
        const std::size_t budget = budget_.load(std::memory_order_relaxed);
        if (size <= budget) {
          while (held_ + size > budget) {
            old.push_back(kept_.front());
            held_ -= kept_.front().size;
            kept_.pop_front();
          }
          kept_.push_back({p, size, now});
          held_ += size;
          kept = true;
        }
      } catch (...) {  // no memory for the lists: unmap it
      }
    }
    for (const Range& r : old) ::munmap(r.data, r.size);
    if (!kept) ::munmap(p, size);
  }

  std::size_t held() {
    std::lock_guard lock(mu_);
    return held_;
  }
  std::size_t budget() const { return budget_.load(std::memory_order_relaxed); }
  void set_budget(std::size_t bytes) {
    budget_.store(bytes, std::memory_order_relaxed);
    std::vector<Range> old;
    {
      std::lock_guard lock(mu_);
      while (held_ > bytes) {
        old.push_back(kept_.front());
        held_ -= kept_.front().size;
        kept_.pop_front();
      }
    }
    for (const Range& r : old) ::munmap(r.data, r.size);
  }

  void clear() {
    std::deque<Range> old;
    {
      std::lock_guard lock(mu_);
      old.swap(kept_);
      held_ = 0;
    }
    for (const Range& r : old) ::munmap(r.data, r.size);
  }

 private:
  struct Range {
    std::byte* data;
    std::size_t size;
    Clock::time_point since;
  };
  // Moves the ranges kept longer than kMaxAge to `out` (mu_ held; out has room reserved or may
  // grow).
  void expire(Clock::time_point now, std::vector<Range>& out) {
    while (!kept_.empty() && now - kept_.front().since > kMaxAge) {
      out.push_back(kept_.front());
      held_ -= kept_.front().size;
      kept_.pop_front();
    }
  }

  std::mutex mu_;
  std::deque<Range> kept_;
  std::size_t held_ = 0;
  std::atomic<std::size_t> budget_{default_budget()};
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
    std::byte* p = retained().take(size);
    if (p == nullptr) throw std::bad_alloc();
    return Bytes(p, FreeBytes{bytes});
  }
  auto* p = static_cast<std::byte*>(std::aligned_alloc(huge ? kHugePage : 64, size));
  if (p == nullptr) throw std::bad_alloc();
  // Advice only: where the kernel offers no huge pages, the memory is the same, in 4 KiB pages.
  if (huge) ::madvise(p, size, MADV_HUGEPAGE);
  return Bytes(p, FreeBytes{bytes});
}

std::size_t retained_bytes() { return kRetain ? retained().held() : 0; }
std::size_t retained_budget() { return kRetain ? retained().budget() : 0; }
void set_retained_budget(std::optional<std::size_t> bytes) {
  if (kRetain) retained().set_budget(bytes ? *bytes : default_budget());
}
void release_retained() {
  if (kRetain) retained().clear();
}

}  // namespace terse::kit
