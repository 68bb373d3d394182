#include "terse/codec_kit.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "kit/sparse.h"

namespace terse::sparse {

std::size_t count_for(double ratio, std::size_t n) {
  if (n == 0) return 0;
  const double k = std::round(ratio * static_cast<double>(n));
  return std::clamp<std::size_t>(static_cast<std::size_t>(k), 1, n);
}

double read_ratio(SpecReader& r, std::string_view key, double def) {
  return r.number(key, def, 0.0, 1.0, SpecReader::Ends::kLeftOpen);  // 0 would keep nothing
}

void check_encodable(std::size_t n, const std::string& spec) {
  if (n > kMaxElements) {
    throw InvalidArgument(
        fmt::format("terse: {}: {} elements are beyond 32-bit indices; "
                    "partition the tensor",
                    spec, n));
  }
}

std::size_t write(std::span<std::byte> out, const std::uint32_t* idx, const float* val,
                  std::size_t count) {
  const std::size_t bytes = payload_bytes(count);
  if (out.size() < bytes) {
    throw InvalidArgument(
        fmt::format("terse: sparse payload of {} bytes does not fit {}", bytes, out.size()));
  }
  const auto c32 = static_cast<std::uint32_t>(count);
  std::memcpy(out.data(), &c32, 4);
  if (count > 0) {
    std::memcpy(out.data() + 4, idx, 4 * count);
    std::memcpy(out.data() + 4 + 4 * count, val, 4 * count);
  }
  return bytes;
}

void decode(std::span<const std::byte> in, std::span<float> y, DecodeMode mode, const Rules& rules,
            const std::string& spec) {
  const std::size_t n = y.size();
  if (n > kMaxElements) {
    throw DecodeError(fmt::format("terse: {}: {} elements are beyond 32-bit indices", spec, n));
  }
  if (in.size() < 4) {
    throw DecodeError(fmt::format("terse: {}: payload of {} bytes has no count", spec, in.size()));
  }
  std::uint32_t count;
  std::memcpy(&count, in.data(), 4);
  if (count > rules.max_count || (rules.exact_count && count != rules.max_count)) {
    throw DecodeError(
        fmt::format("terse: {}: payload holds {} entries for {} elements "
                    "({} {})",
                    spec, count, n, rules.exact_count ? "expected" : "at most", rules.max_count));
  }
  if (in.size() != payload_bytes(count)) {
    throw DecodeError(fmt::format("terse: {}: payload of {} bytes for {} entries (expected {})",
                                  spec, in.size(), count, payload_bytes(count)));
  }
  const std::byte* idx = in.data() + 4;
  const std::byte* val = idx + 4 * std::size_t{count};
  if (!kit::indices_valid(idx, count, n)) {
    throw DecodeError(
        fmt::format("terse: {}: indices are not strictly increasing below {}", spec, n));
  }
  if (!kit::values_valid(val, count, rules.min_key)) {
    throw DecodeError(
        fmt::format("terse: {}: a value is NaN, Inf or below what the encoder "
                    "sends",
                    spec));
  }
  kit::scatter(idx, val, count, y, mode == DecodeMode::kAccumulate);
}

}  // namespace terse::sparse
