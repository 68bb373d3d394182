#include "kit/memory.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

namespace terse::kit {
namespace {

std::uintptr_t address(const void* p) { return reinterpret_cast<std::uintptr_t>(p); }

// The kernel's THP mode: "always", "madvise" or "never" (empty when it has no THP).
std::string thp_mode() {
  std::ifstream in("/sys/kernel/mm/transparent_hugepage/enabled");
  std::string line;
  std::getline(in, line);
  const auto open = line.find('['), close = line.find(']');
  return open == std::string::npos || close == std::string::npos
             ? ""
             : line.substr(open + 1, close - open - 1);
}

// /proc/self/smaps' THPeligible for the mapping that holds p (-1 when not found).
int thp_eligible(const void* p) {
  std::ifstream in("/proc/self/smaps");
  std::string line;
  bool inside = false;
  while (std::getline(in, line)) {
    std::uintptr_t lo = 0, hi = 0;
    char dash = 0;
    std::istringstream head(line);
    if (head >> std::hex >> lo >> dash >> hi && dash == '-' && line.find(':') > line.find(' ')) {
      inside = lo <= address(p) && address(p) < hi;
      continue;
    }
    if (inside && line.rfind("THPeligible:", 0) == 0) return std::stoi(line.substr(12));
  }
  return -1;
}

TEST(Memory, SmallBlocksAreCacheLineAligned) {
  for (std::size_t bytes : {0, 1, 63, 64, 100, 4096, 1 << 20}) {
    Bytes b = allocate_bytes(bytes);
    ASSERT_NE(b.get(), nullptr) << bytes;
    EXPECT_EQ(address(b.get()) % 64, 0u) << bytes;
  }
}

TEST(Memory, LargeBlocksAreHugePageAlignedAndAdvised) {
  Bytes b = allocate_bytes(kHugePage * 2 + 123);
  ASSERT_NE(b.get(), nullptr);
  EXPECT_EQ(address(b.get()) % kHugePage, 0u);
  const std::string mode = thp_mode();
  if (mode != "always" && mode != "madvise") GTEST_SKIP() << "no transparent huge pages";
  // Under "madvise", only MADV_HUGEPAGE makes a mapping eligible; under "always" every large
  // enough, aligned one is.
  EXPECT_EQ(thp_eligible(b.get()), 1);
}

TEST(Memory, PageArraysAreZeroedUnlessAskedNotTo) {
  PageArray<float> a(kHugePage / sizeof(float) + 5);
  EXPECT_EQ(a.size(), kHugePage / sizeof(float) + 5);
  double sum = 0;
  for (float v : a.all()) sum += v != 0.0f;
  EXPECT_EQ(sum, 0);
  a[a.size() - 1] = 2.5f;
  std::span<const float> view = a;
  EXPECT_EQ(view.back(), 2.5f);
  // Iterable like a container, over all of its elements.
  EXPECT_EQ(a.begin(), a.data());
  EXPECT_EQ(a.end() - a.begin(), static_cast<std::ptrdiff_t>(a.size()));
  std::size_t seen = 0;
  for (float& v : a) seen += v == 2.5f;
  EXPECT_EQ(seen, 1u);
  PageArray<std::uint8_t> raw(10, PageArray<std::uint8_t>::Init::kNone);
  EXPECT_EQ(raw.size(), 10u);
  EXPECT_EQ(PageArray<float>().size(), 0u);
}

#if !defined(__SANITIZE_ADDRESS__)
// Fills a block of `pages` huge pages with its page index plus `mark` at each page's start.
void mark_pages(std::byte* p, std::size_t pages, int mark) {
  for (std::size_t i = 0; i < pages; ++i) p[i * kHugePage] = static_cast<std::byte>(mark + i);
}

TEST(Memory, FreedLargeBlocksAreReusedForTheSameSize) {
  if (retained_budget() < 8 * kHugePage) GTEST_SKIP() << "TERSE_RETAIN_MB keeps too little";
  release_retained();
  std::byte* first = nullptr;
  {
    Bytes b = allocate_bytes(kHugePage + 1);  // rounds to 2 huge pages
    first = b.get();
    b[0] = std::byte{7};
  }
  EXPECT_EQ(retained_bytes(), 2 * kHugePage);
  Bytes again = allocate_bytes(2 * kHugePage);  // the same rounded size: the kept block
  EXPECT_EQ(again.get(), first);
  EXPECT_EQ(again[0], std::byte{7});  // the same pages, not fresh ones
  EXPECT_EQ(retained_bytes(), 0u);
  EXPECT_EQ(address(again.get()) % kHugePage, 0u);
  release_retained();
}

TEST(Memory, ASmallerRequestTakesTheHeadOfTheSmallestLargerKeptBlock) {
  if (retained_budget() < 16 * kHugePage) GTEST_SKIP() << "TERSE_RETAIN_MB keeps too little";
  release_retained();
  std::byte* three = nullptr;
  {
    Bytes big = allocate_bytes(6 * kHugePage);
    Bytes mid = allocate_bytes(3 * kHugePage);
    three = mid.get();
    mark_pages(mid.get(), 3, 40);
  }
  EXPECT_EQ(retained_bytes(), 9 * kHugePage);
  // 2 pages: the 3-page block's head (the smallest that holds it), not the 6-page one's.
  Bytes two = allocate_bytes(2 * kHugePage);
  EXPECT_EQ(two.get(), three);
  EXPECT_EQ(two[kHugePage], std::byte{41});
  EXPECT_EQ(retained_bytes(), 7 * kHugePage);
  // Its tail, one page, is still kept, and serves a request of one page.
  Bytes one = allocate_bytes(kHugePage);
  EXPECT_EQ(one.get(), three + 2 * kHugePage);
  EXPECT_EQ(one[0], std::byte{42});
  EXPECT_EQ(retained_bytes(), 6 * kHugePage);
  release_retained();
}

TEST(Memory, ALargerRequestGathersKeptBlocksWithoutTouchingTheirPages) {
  if (retained_budget() < 16 * kHugePage) GTEST_SKIP() << "TERSE_RETAIN_MB keeps too little";
  release_retained();
  {
    Bytes newer = allocate_bytes(3 * kHugePage);
    Bytes older = allocate_bytes(2 * kHugePage);
    mark_pages(older.get(), 2, 10);
    mark_pages(newer.get(), 3, 20);
    // Destroyed in reverse order: `older` is freed first, `newer` is the newest kept block.
  }
  EXPECT_EQ(retained_bytes(), 5 * kHugePage);
  // 4 pages: more than any kept block. The newest block's 3 pages, then the head of the other.
  Bytes four = allocate_bytes(4 * kHugePage);
  ASSERT_NE(four.get(), nullptr);
  EXPECT_EQ(address(four.get()) % kHugePage, 0u);
  EXPECT_EQ(four[0], std::byte{20});
  EXPECT_EQ(four[kHugePage], std::byte{21});
  EXPECT_EQ(four[2 * kHugePage], std::byte{22});
  EXPECT_EQ(four[3 * kHugePage], std::byte{10});
  EXPECT_EQ(retained_bytes(), kHugePage);  // the older block's second page
  // More than all that is kept: the kept page, then fresh (zero) memory; every byte writable.
  Bytes eight = allocate_bytes(8 * kHugePage);
  EXPECT_EQ(eight[0], std::byte{11});
  EXPECT_EQ(eight[kHugePage], std::byte{0});
  std::memset(eight.get(), 1, 8 * kHugePage);
  EXPECT_EQ(retained_bytes(), 0u);
  const std::string mode = thp_mode();
  if (mode == "always" || mode == "madvise") {
    EXPECT_EQ(thp_eligible(four.get()), 1);  // moved ranges keep their advice
  }
  release_retained();
}

TEST(Memory, SmallBlocksAndBlocksOverTheBudgetAreNotKept) {
  release_retained();
  { Bytes small = allocate_bytes(kHugePage - 1); }
  EXPECT_EQ(retained_bytes(), 0u);
  { Bytes big = allocate_bytes(retained_budget() + kHugePage); }
  EXPECT_EQ(retained_bytes(), 0u);
  // Filling the budget frees the oldest blocks first: what is kept never exceeds it.
  {
    std::vector<Bytes> blocks;
    for (int i = 0; i < 3; ++i) blocks.push_back(allocate_bytes(retained_budget() / 2));
  }
  EXPECT_LE(retained_bytes(), retained_budget());
  EXPECT_GT(retained_bytes(), 0u);
  release_retained();
}
#endif

}  // namespace
}  // namespace terse::kit
