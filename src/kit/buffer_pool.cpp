#include "kit/buffer_pool.h"

#include <bit>
#include <cstring>
#include <new>
#include <utility>

namespace terse::kit {

Buffer& Buffer::operator=(Buffer&& other) noexcept {
  if (this != &other) {
    release();
    pool_ = std::exchange(other.pool_, nullptr);
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
    capacity_ = std::exchange(other.capacity_, 0);
  }
  return *this;
}

void Buffer::release() noexcept {
  if (pool_ != nullptr) pool_->give_back(data_, capacity_);
  pool_ = nullptr;
  data_ = nullptr;
  size_ = capacity_ = 0;
}

// Powers of two up to 1 MiB, then steps of 1/8 of a power of two: at most 12.5% slack for the
// large staging buffers, while a tensor whose size varies a little still reuses its block.
std::size_t BufferPool::size_class(std::size_t bytes) {
  constexpr std::size_t kMin = 4096;
  if (bytes <= kMin) return kMin;
  if (bytes <= (std::size_t{1} << 20)) return std::bit_ceil(bytes);
  const std::size_t step = std::bit_floor(bytes) / 8;
  return (bytes + step - 1) / step * step;
}

Buffer BufferPool::acquire(std::size_t bytes) {
  const std::size_t cap = size_class(bytes);
  Buffer b;
  b.pool_ = this;
  b.size_ = bytes;
  b.capacity_ = cap;
  std::vector<kit::Bytes> idle;  // freed outside the lock
  {
    std::lock_guard lock(mu_);
    auto it = free_.find(cap);
    if (it != free_.end()) {
      b.data_ = it->second.data;
      free_.erase(it);
      return b;
    }
    idle = take_idle(Clock::now());
  }
  idle.clear();
  kit::Bytes block = kit::allocate_bytes(cap);  // huge pages when large (kit/memory.h)
  std::byte* p = block.get();
  // Touch every page now, once, so that no later use pays for first-touch faults.
  std::memset(p, 0, cap);
  std::lock_guard lock(mu_);
  owned_.emplace(p, std::move(block));
  held_ += cap;
  b.data_ = p;
  return b;
}

std::vector<kit::Bytes> BufferPool::take_idle(Clock::time_point now) {
  std::vector<kit::Bytes> out;
  // A sweep walks every free block: at most a few times per idle period.
  if (now - swept_ < idle_ / 4) return out;
  swept_ = now;
  for (auto it = free_.begin(); it != free_.end();) {
    if (now - it->second.since <= idle_) {
      ++it;
      continue;
    }
    auto owned = owned_.find(it->second.data);
    out.push_back(std::move(owned->second));
    owned_.erase(owned);
    held_ -= it->first;
    it = free_.erase(it);
  }
  return out;
}

void BufferPool::give_back(std::byte* data, std::size_t capacity) noexcept {
  std::vector<kit::Bytes> idle;
  {
    std::lock_guard lock(mu_);
    const Clock::time_point now = Clock::now();
    free_.emplace(capacity, Free{data, now});
    try {
      idle = take_idle(now);
    } catch (...) {  // no memory for the list: the blocks stay until the next sweep
    }
  }
}

std::size_t BufferPool::held_bytes() const {
  std::lock_guard lock(mu_);
  return held_;
}

}  // namespace terse::kit
