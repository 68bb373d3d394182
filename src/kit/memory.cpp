#include "kit/memory.h"

#include <sys/mman.h>

#include <algorithm>
#include <cstdlib>
#include <new>

namespace terse::kit {

void FreeBytes::operator()(std::byte* p) const noexcept { std::free(p); }

Bytes allocate_bytes(std::size_t bytes) {
  bytes = std::max<std::size_t>(bytes, 1);
  const bool huge = bytes >= kHugePage;
  const std::size_t align = huge ? kHugePage : 64;
  const std::size_t size = (bytes + align - 1) / align * align;  // aligned_alloc's requirement
  auto* p = static_cast<std::byte*>(std::aligned_alloc(align, size));
  if (p == nullptr) throw std::bad_alloc();
  // Advice only: where the kernel offers no huge pages, the memory is the same, in 4 KiB pages.
  if (huge) ::madvise(p, size, MADV_HUGEPAGE);
  return Bytes(p);
}

}  // namespace terse::kit
