// How terse's users of one Communicator share its tag space, so that no two of them can match
// each other's messages. Partition tasks of the engine's collectives use
// (signature << 32) | (sequence << 16) | index with a 23-bit signature hashed from the task; tag
// bit 55 stays clear there, because terse::Channel's messages set it. Signatures from
// kFirstReservedSignature up are kept for the exchanges below (the engine's first-use check, the
// planner's link calibration, the trace's clock alignment), which sit in different layers: the
// map lives here, in the layer all of them use.
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
