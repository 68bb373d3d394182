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
#include <span>
#include <type_traits>

namespace terse::kit {

inline constexpr std::size_t kHugePage = std::size_t{2} << 20;

struct FreeBytes {
  void operator()(std::byte* p) const noexcept;
};
using Bytes = std::unique_ptr<std::byte[], FreeBytes>;

// At least `bytes` bytes (at least one), 64-byte aligned, as described above; contents
// unspecified. Throws std::bad_alloc.
Bytes allocate_bytes(std::size_t bytes);

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

 private:
  Bytes data_;
  std::size_t n_ = 0;
};

}  // namespace terse::kit
