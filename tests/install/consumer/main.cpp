// Uses the installed public API only: lists the codecs, then encodes and decodes a vector with a
// lossless and a lossy codec and checks what comes back. Exits non-zero on any mismatch.
#include <terse/codec.h>

#include <cmath>
#include <cstddef>
#include <cstdio>
#include <vector>

namespace {

int check(const char* spec, const std::vector<float>& x, float tolerance) {
  const auto codec = terse::make_codec(spec);
  std::vector<std::byte> payload(codec->max_encoded_bytes(x.size()));
  terse::EncodeContext ctx;
  const std::size_t bytes = codec->encode(x, payload, ctx);
  std::vector<float> y(x.size());
  codec->decode(std::span(payload).first(bytes), y);
  float worst = 0.0f;
  for (std::size_t i = 0; i < x.size(); ++i) worst = std::fmax(worst, std::fabs(x[i] - y[i]));
  std::printf("%-16s %zu floats -> %zu bytes, largest error %g\n", codec->spec().c_str(),
              x.size(), bytes, static_cast<double>(worst));
  return worst <= tolerance ? 0 : 1;
}

}  // namespace

int main() {
  const auto codecs = terse::registered_codecs();
  std::printf("%zu codecs:", codecs.size());
  for (const auto& info : codecs) std::printf(" %s", info.name.c_str());
  std::printf("\n");
  if (codecs.empty()) return 1;

  std::vector<float> x(1000);
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = std::sin(0.01f * static_cast<float>(i));
  int failures = 0;
  failures += check("none", x, 0.0f);
  failures += check("fp16", x, 1e-3f);
  try {
    terse::make_codec("no-such-codec");
    ++failures;
  } catch (const terse::Error& e) {
    std::printf("unknown codec rejected: %s\n", e.what());
  }
  std::printf(failures == 0 ? "ok\n" : "FAILED\n");
  return failures == 0 ? 0 : 1;
}
