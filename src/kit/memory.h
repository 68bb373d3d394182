// Large buffers that are cheap to touch for the first time. On the machines this project runs
// on, the first write to each 4 KiB page of fresh memory costs 10-20 us (shared/CLUSTER.md): a
// 128 MiB scratch buffer takes half a second to fault in, longer than the allreduce it serves.
// Arrays of at least kHugePage bytes are therefore aligned to 2 MiB and advised as transparent
// huge pages (MADV_HUGEPAGE; the kernel's "madvise" mode honours it), so that they fault in 2 MiB
// at a time; smaller ones come from the allocator, 64-byte aligned.
#pragma once

#include <cstddef>
#include <cstring>
#include <memory>
#include <optional>
#include <span>
#include <type_traits>

namespace terse::kit {

inline constexpr std::size_t kHugePage = std::size_t{2} << 20;

// Frees a block of allocate_bytes(bytes); `bytes` must be the size asked for (it tells a mapped
// block from an allocator's, below).
struct FreeBytes {
  std::size_t bytes = 0;
  void operator()(std::byte* p) const noexcept;
};
using Bytes = std::unique_ptr<std::byte[], FreeBytes>;

// At least `bytes` bytes (at least one), 64-byte aligned, as described above; contents
// unspecified. Throws std::bad_alloc.
//
// Large blocks are kept for reuse when freed: memory given back to the kernel is fresh again
// when next touched, and on the virtual machines this project runs on a freed page is also
// handed back to the hypervisor (free page reporting), so the kernel's next use of it, a socket
// buffer included, faults it in again from the host. A job that switches configurations (the
// planner exploring, a benchmark) frees and allocates large blocks over and over; at 256 MiB
// that churn made allreduces several times slower than the same configuration run steadily.
// A block of at least kHugePage bytes is therefore mapped memory
// of its own, and when freed it is kept, up to retained_budget() bytes in all, for any later
// request of that size or another: a kept block of the same rounded size, else the head of
// the smallest larger one, else kept blocks moved (mremap, no copy) into one new block, as
// many as it takes to cover it. When the budget is full, the blocks kept longest are unmapped
// first, and a block kept for more than a minute is unmapped at the next allocation or free.
// Not under AddressSanitizer, which must see every free: there every block is aligned_alloc's.
Bytes allocate_bytes(std::size_t bytes);

// Bytes of freed blocks kept for reuse, and the most that are kept: as set by
// set_retained_budget (0 keeps none), by default the lesser of 1 GiB and 1/16 of the machine's
// memory. Process-wide (ProcessOptions::retained_bytes, TERSE_RETAIN_MB at the edge); a lower
// budget unmaps the oldest kept blocks beyond it at once. Nothing: the default.
std::size_t retained_bytes();
std::size_t retained_budget();
void set_retained_budget(std::optional<std::size_t> bytes);
// Frees every kept block now.
void release_retained();

// A fixed-size array of n trivially copyable T in such memory.
template <typename T>
class PageArray {
  static_assert(std::is_trivially_copyable_v<T>);

 public:
  enum class Init { kZero, kNone };
  PageArray() = default;
  explicit PageArray(std::size_t n, Init init = Init::kZero)
      : data_(allocate_bytes(n * sizeof(T))), n_(n) {
    if (init == Init::kZero) std::memset(data_.get(), 0, n * sizeof(T));
  }

  T* data() const { return reinterpret_cast<T*>(data_.get()); }
  std::size_t size() const { return n_; }
  std::span<T> all() const { return {data(), n_}; }
  operator std::span<T>() const { return all(); }        // NOLINT: a view of the array
  operator std::span<const T>() const { return all(); }  // NOLINT
  T& operator[](std::size_t i) const { return data()[i]; }
  T* begin() const { return data(); }
  T* end() const { return data() + n_; }

 private:
  Bytes data_;
  std::size_t n_ = 0;
};

}  // namespace terse::kit
