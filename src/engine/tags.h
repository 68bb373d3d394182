// Message tags of the engine's own exchanges that are not partition tasks. A task's tag is
// (signature << 32) | (sequence << 16) | index with a 23-bit signature hashed from the task (tag
// bit 55 stays clear: terse::Channel's messages set it); signatures from kFirstReservedSignature
// up are kept for the exchanges below, so that they can never be matched with a task's messages.
#pragma once

#include <cstdint>

namespace terse::tags {

constexpr std::uint64_t kSignatureMask = 0x7fffff;
constexpr std::uint64_t kFirstReservedSignature = 0x7ffff0;
constexpr std::uint64_t kVerifySignature = 0x7fffff;   // first-use check of a submission
constexpr std::uint64_t kPlannerSignature = 0x7ffffe;  // planner: link calibration
constexpr std::uint64_t kClockSignature = 0x7ffffd;    // trace clock alignment

// A tag of a reserved exchange: `round` < 2^16 and `index` < 2^16 distinguish its messages.
constexpr std::uint64_t reserved(std::uint64_t signature, std::uint32_t round,
                                 std::uint32_t index) {
  return (signature << 32) | (std::uint64_t{round & 0xffff} << 16) | (index & 0xffff);
}

}  // namespace terse::tags
