// The element types terse reduces: fp32, and the two 16-bit formats that mixed-precision
// training keeps its gradients in.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>

#include "terse/export.h"

namespace terse {

enum class DType : std::uint8_t {
  kFloat32,   // IEEE binary32
  kFloat16,   // IEEE binary16
  kBFloat16,  // bfloat16: the upper half of a binary32
};

// "float32", "float16", "bfloat16".
TERSE_API std::string_view to_string(DType d);
inline std::size_t element_bytes(DType d) { return d == DType::kFloat32 ? 4 : 2; }

// A tensor of any supported element type: its first element, its element count and its type.
// A borrowed view: the memory belongs to the caller.
struct TensorView {
  void* data = nullptr;
  std::size_t elements = 0;
  DType dtype = DType::kFloat32;

  TensorView() = default;
  TensorView(void* d, std::size_t n, DType t) : data(d), elements(n), dtype(t) {}
  explicit TensorView(std::span<float> x) : data(x.data()), elements(x.size()) {}
  std::size_t bytes() const { return elements * element_bytes(dtype); }
  // The 16-bit values of a half tensor.
  std::span<std::uint16_t> half() const {
    return {static_cast<std::uint16_t*>(data), elements};
  }
  std::span<float> floats() const { return {static_cast<float*>(data), elements}; }
};

}  // namespace terse
