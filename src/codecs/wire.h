// The payload header shared by every codec (Codec::kHeaderBytes long). All multi-byte fields are
// little-endian; terse only builds on little-endian hosts (checked at compile time). The readers
// and writers for the bytes after it are public (terse/codec_kit.h).
//
//   offset size field
//   0      2    magic 0x5354 ("TS")
//   2      1    version (1)
//   3      1    codec id
//   4      4    parameter digest (FNV-1a of the canonical spec)
//   8      8    element count
//   16     8    payload length in bytes (what follows the header)
#pragma once

#include <bit>
#include <cstdint>

#include "terse/codec.h"
#include "terse/codec_kit.h"

namespace terse::wire {

static_assert(std::endian::native == std::endian::little, "terse's wire format is little-endian");
static_assert(Codec::kHeaderBytes == 2 + 1 + 1 + 4 + 8 + 8, "the fields above");

inline constexpr std::uint16_t kMagic = 0x5354;
inline constexpr std::uint8_t kVersion = 1;
// The codec id of the collectives' in-band failure messages, which no codec may take.
inline constexpr std::uint8_t kFailureId = 0xff;

}  // namespace terse::wire
