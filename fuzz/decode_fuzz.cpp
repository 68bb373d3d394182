// libFuzzer target for one codec's decoder, chosen at build time by TERSE_FUZZ_SPEC.
// Half of the inputs are fed to decode() as they are (fuzzing the header checks); the other
// half get a valid header for this codec prepended, so the fuzzer spends its effort on the
// payload parser behind it. Summable codecs also fuzz combine() into a valid accumulator.
// Any exception other than terse::DecodeError, any crash or sanitizer report is a finding.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "terse/codec.h"

#ifndef TERSE_FUZZ_SPEC
#error "define TERSE_FUZZ_SPEC"
#endif

namespace {

const terse::Codec& codec() {
  static const std::unique_ptr<terse::Codec> c = terse::make_codec(TERSE_FUZZ_SPEC);
  return *c;
}

std::vector<std::byte> with_header(std::uint64_t n, const std::uint8_t* data, std::size_t size) {
  std::vector<std::byte> out(24 + size);
  std::uint16_t magic = 0x5354;
  std::uint8_t version = 1, id = codec().id();
  std::uint32_t digest = codec().param_digest();
  std::uint64_t len = size;
  std::memcpy(out.data(), &magic, 2);
  std::memcpy(out.data() + 2, &version, 1);
  std::memcpy(out.data() + 3, &id, 1);
  std::memcpy(out.data() + 4, &digest, 4);
  std::memcpy(out.data() + 8, &n, 8);
  std::memcpy(out.data() + 16, &len, 8);
  if (size) std::memcpy(out.data() + 24, data, size);
  return out;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size < 3) return 0;
  const bool raw = data[0] & 1;
  const std::uint64_t n = (static_cast<std::uint64_t>(data[1]) << 8 | data[2]) % 3000;
  data += 3;
  size -= 3;
  std::vector<std::byte> payload =
      raw ? std::vector<std::byte>(reinterpret_cast<const std::byte*>(data),
                                   reinterpret_cast<const std::byte*>(data) + size)
          : with_header(n, data, size);
  std::vector<float> y(n, 1.0f);
  try {
    codec().decode(payload, y, (n & 1) ? terse::DecodeMode::kAccumulate
                                       : terse::DecodeMode::kOverwrite);
  } catch (const terse::DecodeError&) {
  }
  if (codec().traits().summable && !raw) {
    std::vector<float> x(n, 0.5f);
    auto state = codec().make_state(n);
    terse::EncodeContext ctx;
    ctx.state = state.get();
    std::vector<std::byte> acc(codec().max_encoded_bytes(n));
    acc.resize(codec().encode(x, acc, ctx));
    try {
      codec().combine(payload, acc);
    } catch (const terse::DecodeError&) {
    }
  }
  return 0;
}
