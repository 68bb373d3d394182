// Scalar reference of kit::quantize_levels (TernGrad, QSGD) written from its documentation:
// the codecs' vector kernels must reproduce these bytes exactly.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <span>
#include <vector>

#include "kit/random.h"

namespace terse::testing {

struct LevelReference {
  bool l2 = false;     // QSGD's L2 norm, else max |x| (TernGrad)
  int levels = 1;
  int width = 2;
  std::size_t bucket = 0;  // 0 = whole tensor
};

inline float reference_norm(const LevelReference& r, std::span<const float> x) {
  if (!r.l2) {
    float m = 0;
    for (float v : x) m = std::max(m, std::fabs(v));
    return m;
  }
  // Eight lanes over groups of eight, then the rest in order (the kit's fixed summation order).
  double lanes[8] = {};
  std::size_t j = 0;
  for (; j + 8 <= x.size(); j += 8) {
    for (int k = 0; k < 8; ++k) lanes[k] += static_cast<double>(x[j + k]) * x[j + k];
  }
  double q = 0;
  for (double l : lanes) q += l;
  for (; j < x.size(); ++j) q += static_cast<double>(x[j]) * x[j];
  double n = std::sqrt(q);
  return n > 3.4028234663852886e38 ? 3.4028234663852886e38f : static_cast<float>(n);
}

// The payload after the header: norms, then each bucket's packed codes.
inline std::vector<std::uint8_t> reference_levels(const LevelReference& r,
                                                  std::span<const float> x, std::uint64_t key) {
  const std::size_t n = x.size();
  const std::size_t bucket = r.bucket == 0 ? std::max<std::size_t>(n, 1) : r.bucket;
  std::vector<std::uint8_t> norms, codes;
  const std::size_t per = r.width < 16 ? 8 / r.width : 1, block = 16 * per;
  for (std::size_t start = 0; start < n; start += bucket) {
    auto xb = x.subspan(start, std::min(bucket, n - start));
    float norm = reference_norm(r, xb);
    std::uint8_t nb[4];
    std::memcpy(nb, &norm, 4);
    norms.insert(norms.end(), nb, nb + 4);
    float pre = 1, mult = 0;
    if (norm > 0) {
      if (norm < 0x1p-100f) pre = 0x1p100f;
      mult = static_cast<float>(r.levels / (static_cast<double>(norm) * pre));
    }
    std::vector<std::uint32_t> c(xb.size());
    for (std::size_t i = 0; i < xb.size(); ++i) {
      float u = kit::uniform_at(key, start + i);
      float a = std::min(std::fabs(xb[i]) * pre * mult, static_cast<float>(r.levels));
      float fl = std::floor(a);
      int l = static_cast<int>(fl) + (u < a - fl ? 1 : 0);
      c[i] = static_cast<std::uint32_t>(std::signbit(xb[i]) ? r.levels - l : r.levels + l);
    }
    std::size_t first = codes.size();
    codes.resize(first + kit::packed_bytes(xb.size(), r.width));
    std::uint8_t* out = codes.data() + first;
    if (r.width == 16) {
      for (std::size_t i = 0; i < xb.size(); ++i) {
        out[2 * i] = static_cast<std::uint8_t>(c[i]);
        out[2 * i + 1] = static_cast<std::uint8_t>(c[i] >> 8);
      }
      continue;
    }
    std::size_t full = xb.size() / block * block;
    for (std::size_t i = 0; i < xb.size(); ++i) {
      std::size_t byte, shift;
      if (i < full) {  // byte j of the block holds elements j, j+16, ...
        std::size_t in_block = i % block;
        byte = i / block * 16 + in_block % 16;
        shift = r.width * (in_block / 16);
      } else {  // the partial block is sequential
        byte = full / block * 16 + (i - full) / per;
        shift = r.width * ((i - full) % per);
      }
      out[byte] = static_cast<std::uint8_t>(out[byte] | c[i] << shift);
    }
  }
  norms.insert(norms.end(), codes.begin(), codes.end());
  return norms;
}

}  // namespace terse::testing
