#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>

#include "terse/codec.h"

namespace terse {
namespace {

TEST(Workspace, GrowsOnlyWhenASlotIsAskedForMoreThanItHolds) {
  Workspace w;
  EXPECT_EQ(w.slots(), 0u);
  EXPECT_EQ(w.slot_bytes(3), 0u);
  auto a = w.get<float>(3, 1000);
  EXPECT_EQ(a.size(), 1000u);
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(a.data()) % 64, 0u);
  EXPECT_EQ(w.slots(), 4u);
  EXPECT_GE(w.slot_bytes(3), 1000 * sizeof(float));
  EXPECT_EQ(w.growths(), 1u);
  auto b = w.get<float>(3, 500);  // fits: the same memory
  EXPECT_EQ(b.data(), a.data());
  EXPECT_EQ(w.growths(), 1u);
  w.get<float>(3, 100000);
  EXPECT_EQ(w.growths(), 2u);
}

TEST(Workspace, ReserveGrowsASlotAheadSoThatGetsUpToItDoNotGrow) {
  Workspace w;
  constexpr std::size_t kBytes = std::size_t{5} << 20;  // large: huge pages, kept when freed
  w.reserve(Workspace::kWrapperSlot, kBytes);
  EXPECT_EQ(w.slot_bytes(Workspace::kWrapperSlot), kBytes);
  EXPECT_EQ(w.growths(), 1u);
  w.reserve(Workspace::kWrapperSlot, kBytes / 2);  // holds it already
  EXPECT_EQ(w.growths(), 1u);
  // get() pads for alignment: a request a cache line under the reserve fits.
  auto s = w.get<std::byte>(Workspace::kWrapperSlot, kBytes - 64);
  s[0] = s[s.size() - 1] = std::byte{1};
  EXPECT_EQ(w.growths(), 1u);
  w.get<std::byte>(Workspace::kWrapperSlot, kBytes + 1);
  EXPECT_EQ(w.growths(), 2u);
  EXPECT_GE(w.slot_bytes(Workspace::kWrapperSlot), kBytes + 1);
}

}  // namespace
}  // namespace terse
