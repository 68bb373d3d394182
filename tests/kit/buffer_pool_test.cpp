// The buffer pool: blocks are reused while they are used and released once idle.
#include "kit/buffer_pool.h"

#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <thread>

namespace terse::kit {
namespace {

using namespace std::chrono_literals;

TEST(BufferPool, ReusesBlocksOfTheSameSizeClass) {
  BufferPool pool;
  const std::byte* first = nullptr;
  {
    Buffer b = pool.acquire(100000);
    ASSERT_GE(b.size(), 100000u);
    std::memset(b.bytes().data(), 1, b.size());
    first = b.bytes().data();
  }
  const std::size_t held = pool.held_bytes();
  EXPECT_GE(held, 100000u);
  Buffer again = pool.acquire(99000);  // the same size class
  EXPECT_EQ(again.bytes().data(), first);
  EXPECT_EQ(pool.held_bytes(), held);
  Buffer second = pool.acquire(99000);  // the first is on loan: a new block
  EXPECT_NE(second.bytes().data(), first);
  EXPECT_EQ(pool.held_bytes(), 2 * held);
}

TEST(BufferPool, ReleasesBlocksIdleForLongerThanItsLimit) {
  BufferPool pool(40ms);
  { Buffer old = pool.acquire(std::size_t{1} << 20); }  // a configuration no longer run
  const std::size_t one = pool.held_bytes();
  ASSERT_EQ(one, std::size_t{1} << 20);
  // Used again within the limit: kept.
  { Buffer b = pool.acquire(std::size_t{1} << 20); }
  EXPECT_EQ(pool.held_bytes(), one);
  std::this_thread::sleep_for(100ms);
  // Another size's first use: the idle block is released, the new one held.
  Buffer fresh = pool.acquire(std::size_t{3} << 20);
  EXPECT_EQ(pool.held_bytes(), std::size_t{3} << 20);
  // A block on loan is never released, however long it is held.
  std::this_thread::sleep_for(100ms);
  { Buffer other = pool.acquire(4096); }
  EXPECT_EQ(pool.held_bytes(), (std::size_t{3} << 20) + 4096);
}

}  // namespace
}  // namespace terse::kit
