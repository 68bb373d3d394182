// Reusable byte buffers for hot paths (the engine's and its collectives'). Fresh pages cost about
// 10 µs each on the machines we target (shared/CLUSTER.md), so payloads, receive areas and
// staging sums are taken from and returned to this pool rather than allocated per call.
// Thread-safe.
#pragma once

#include <chrono>
#include <cstddef>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <unordered_map>
#include <vector>

#include "kit/memory.h"

namespace terse::kit {

class BufferPool;

// A buffer on loan from a pool; returned when destroyed. Move-only.
class Buffer {
 public:
  Buffer() = default;
  Buffer(Buffer&& other) noexcept { *this = std::move(other); }
  Buffer& operator=(Buffer&& other) noexcept;
  ~Buffer() { release(); }

  std::span<std::byte> bytes() const { return {data_, size_}; }
  template <typename T>
  std::span<T> as(std::size_t n) const {
    return {reinterpret_cast<T*>(data_), n};
  }
  std::size_t size() const { return size_; }

 private:
  friend class BufferPool;
  void release() noexcept;
  BufferPool* pool_ = nullptr;
  std::byte* data_ = nullptr;
  std::size_t size_ = 0;      // what the caller asked for
  std::size_t capacity_ = 0;  // the block's size class
};

// Blocks are kept for reuse while they are used: a free block idle for longer than `idle`
// (10 s by default) is released, so that the buffers of a configuration the engine no longer
// runs (a tensor re-planned or explored with other partitions, strategy or codec) do not stay
// held for the rest of the job. A training step that reuses its tensors' blocks well within
// that time never releases one.
class BufferPool {
 public:
  explicit BufferPool(std::chrono::steady_clock::duration idle = std::chrono::seconds(10))
      : idle_(idle) {}
  BufferPool(const BufferPool&) = delete;
  BufferPool& operator=(const BufferPool&) = delete;

  // A buffer of at least `bytes` bytes, 64-byte aligned, contents unspecified.
  Buffer acquire(std::size_t bytes);
  // Bytes held by the pool (on loan or free).
  std::size_t held_bytes() const;

 private:
  friend class Buffer;
  using Clock = std::chrono::steady_clock;
  struct Free {
    std::byte* data;
    Clock::time_point since;  // returned to the pool then
  };
  void give_back(std::byte* data, std::size_t capacity) noexcept;
  // Moves the free blocks idle for longer than idle_ out of the pool (mu_ held); the caller
  // frees them after unlocking.
  std::vector<kit::Bytes> take_idle(Clock::time_point now);
  static std::size_t size_class(std::size_t bytes);

  Clock::duration idle_;
  mutable std::mutex mu_;
  std::multimap<std::size_t, Free> free_;  // capacity -> block
  std::unordered_map<std::byte*, kit::Bytes> owned_;
  std::size_t held_ = 0;
  Clock::time_point swept_{};
};

}  // namespace terse::kit
