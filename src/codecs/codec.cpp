// The Codec base class (header handling), Workspace, EncodeContext and the codec registry.
#include "terse/codec.h"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <cstring>
#include <map>
#include <mutex>

#include "codecs/wire.h"
#include "kit/basic.h"
#include "kit/hash.h"
#include "kit/memory.h"

namespace terse {

std::string_view to_string(DType d) {
  switch (d) {
    case DType::kFloat32: return "float32";
    case DType::kFloat16: return "float16";
    case DType::kBFloat16: return "bfloat16";
  }
  return "?";
}

// ---- Workspace ----------------------------------------------------------------------------

void Workspace::Block::Free::operator()(std::byte* p) const noexcept { kit::FreeBytes{bytes}(p); }

std::byte* Workspace::raw(std::size_t slot, std::size_t bytes, std::size_t align) {
  if (slot >= blocks_.size()) blocks_.resize(slot + 1);
  Block& b = blocks_[slot];
  std::size_t need = bytes + align;
  if (b.size() < need) {
    // Grow geometrically so a tensor that grows a little does not reallocate every call.
    grow(b, std::max(need, b.size() + b.size() / 2));
  }
  auto addr = reinterpret_cast<std::uintptr_t>(b.data.get());
  std::uintptr_t aligned = (addr + align - 1) / align * align;
  return b.data.get() + (aligned - addr);
}

void Workspace::grow(Block& b, std::size_t bytes) {
  b.data = {kit::allocate_bytes(bytes).release(), Block::Free{bytes}};
  ++growths_;
}

void Workspace::reserve(std::size_t slot, std::size_t bytes) {
  if (slot >= blocks_.size()) blocks_.resize(slot + 1);
  Block& b = blocks_[slot];
  if (b.size() >= bytes) return;
  grow(b, bytes);
  // One write per 4 KiB page faults it in now (a huge page at its first).
  for (std::size_t i = 0; i < bytes; i += 4096) b.data[i] = std::byte{0};
}

// ---- EncodeContext ------------------------------------------------------------------------

std::uint64_t EncodeContext::shared_key() const {
  return kit::combine_keys(kit::combine_keys(seed, step), tensor);
}

std::uint64_t EncodeContext::rank_key() const {
  return kit::combine_keys(shared_key(), rank + 0x5bd1e995ull);
}

Workspace& EncodeContext::scratch() const {
  if (workspace) return *workspace;
  thread_local Workspace fallback;
  return fallback;
}

// ---- Codec --------------------------------------------------------------------------------

namespace {
std::uint8_t registered_id(const std::string& name);
}  // namespace

Codec::Codec(const SpecReader& reader)
    : Codec(reader.name(), registered_id(reader.name()), reader.canonical(),
            fnv1a32(reader.canonical())) {}

Codec::Codec(const Codec& wrapped, std::string canonical_spec)
    : Codec(wrapped.name(), wrapped.id(), std::move(canonical_spec), wrapped.param_digest()) {}

Codec::Codec(std::string name, std::uint8_t id, std::string canonical_spec, std::uint32_t digest)
    : name_(std::move(name)), spec_(std::move(canonical_spec)), id_(id), digest_(digest) {}

std::size_t Codec::max_encoded_bytes(std::size_t n) const {
  return kHeaderBytes + max_payload_bytes(n);
}

void Codec::check_encode_args(std::size_t n, std::span<std::byte> out,
                              const EncodeContext& ctx) const {
  if (out.size() < max_encoded_bytes(n)) {
    throw InvalidArgument(fmt::format("terse: {}: output buffer of {} bytes is smaller than "
                                      "max_encoded_bytes({}) = {}",
                                      spec_, out.size(), n, max_encoded_bytes(n)));
  }
  if (traits().stateful && ctx.state == nullptr) {
    throw InvalidArgument(fmt::format("terse: {} is stateful and needs EncodeContext::state",
                                      spec_));
  }
}

std::size_t Codec::write_header(std::size_t n, std::size_t payload,
                                std::span<std::byte> out) const {
  wire::Writer w(out.first(kHeaderBytes));
  w.put(wire::kMagic);
  w.put(wire::kVersion);
  w.put(id_);
  w.put(digest_);
  w.put(static_cast<std::uint64_t>(n));
  w.put(static_cast<std::uint64_t>(payload));
  return kHeaderBytes + payload;
}

std::size_t Codec::encode(std::span<const float> x, std::span<std::byte> out,
                          EncodeContext& ctx) const {
  check_encode_args(x.size(), out, ctx);
  std::size_t payload = encode_payload(x, out.subspan(kHeaderBytes), ctx);
  return write_header(x.size(), payload, out);
}

std::size_t Codec::encode(std::span<const std::uint16_t> x, DType dtype,
                          std::span<std::byte> out, EncodeContext& ctx) const {
  if (dtype == DType::kFloat32) {
    throw InvalidArgument(fmt::format("terse: {}: 16-bit values cannot be float32", spec_));
  }
  check_encode_args(x.size(), out, ctx);
  std::size_t payload = encode_half_payload(x, dtype, out.subspan(kHeaderBytes), ctx);
  return write_header(x.size(), payload, out);
}

std::size_t Codec::encode_half_payload(std::span<const std::uint16_t> x, DType dtype,
                                       std::span<std::byte> out, EncodeContext& ctx) const {
  std::span<float> wide = ctx.scratch().get<float>(Workspace::kInputSlot, x.size());
  kit::widen(dtype, x.data(), wide, false);  // NaN and Inf widen exactly: encode_payload throws
  return encode_payload(wide, out, ctx);
}

PayloadInfo Codec::peek(std::span<const std::byte> in) {
  wire::Reader r(in, "terse");
  if (in.size() < kHeaderBytes) {
    throw DecodeError(fmt::format("terse: payload of {} bytes is shorter than the {}-byte header",
                                  in.size(), kHeaderBytes));
  }
  auto magic = r.get<std::uint16_t>();
  auto version = r.get<std::uint8_t>();
  if (magic != wire::kMagic) {
    throw DecodeError(fmt::format("terse: not a terse payload (magic 0x{:04x})", magic));
  }
  if (version != wire::kVersion) {
    throw DecodeError(fmt::format("terse: payload version {} is not supported (this build "
                                  "reads version {})", version, wire::kVersion));
  }
  PayloadInfo info;
  info.codec_id = r.get<std::uint8_t>();
  info.param_digest = r.get<std::uint32_t>();
  info.elements = r.get<std::uint64_t>();
  info.payload_bytes = r.get<std::uint64_t>();
  if (info.payload_bytes != r.remaining()) {
    throw DecodeError(fmt::format("terse: header announces {} payload bytes but {} follow",
                                  info.payload_bytes, r.remaining()));
  }
  return info;
}

std::span<const std::byte> Codec::checked_payload(std::span<const std::byte> in,
                                                  std::size_t elements) const {
  PayloadInfo info = peek(in);
  if (info.codec_id != id_) {
    std::string other = fmt::format("id {}", info.codec_id);
    for (const auto& c : registered_codecs()) {
      if (c.id == info.codec_id) other = c.name;
    }
    throw DecodeError(fmt::format("terse: {} cannot decode a payload of codec {}", spec_, other));
  }
  if (info.param_digest != digest_) {
    throw DecodeError(fmt::format("terse: {}: payload was encoded with other parameters "
                                  "(digest {:08x}, expected {:08x})",
                                  spec_, info.param_digest, digest_));
  }
  if (info.elements != elements) {
    throw DecodeError(fmt::format("terse: {}: payload holds {} elements, destination has {}",
                                  spec_, info.elements, elements));
  }
  if (info.payload_bytes > max_payload_bytes(elements)) {
    throw DecodeError(fmt::format("terse: {}: payload of {} bytes exceeds the maximum {} for {} "
                                  "elements", spec_, info.payload_bytes,
                                  max_payload_bytes(elements), elements));
  }
  return in.subspan(kHeaderBytes);
}

void Codec::decode(std::span<const std::byte> in, std::span<float> y, DecodeMode mode) const {
  decode_payload(checked_payload(in, y.size()), y, mode);
}

void Codec::expect_payload_bytes(std::span<const std::byte> in, std::size_t elements,
                                 std::size_t expected) const {
  if (in.size() != expected) {
    throw DecodeError(fmt::format("terse: {}: payload of {} bytes for {} elements (expected {})",
                                  spec_, in.size(), elements, expected));
  }
}

std::unique_ptr<CodecState> Codec::make_state(std::size_t) const { return nullptr; }

void Codec::combine(std::span<const std::byte>, std::span<std::byte>) const {
  throw InvalidArgument(fmt::format("terse: {} is not summable; its encodings cannot be added "
                                    "without decoding", spec_));
}

// ---- Registry -----------------------------------------------------------------------------

namespace {

struct Registry {
  std::mutex mu;
  std::map<std::string, CodecInfo, std::less<>> by_name;
};

Registry& registry() {
  static Registry r;  // function-local: safe from any static initializer
  return r;
}

std::uint8_t registered_id(const std::string& name) {
  Registry& r = registry();
  std::lock_guard lock(r.mu);
  auto it = r.by_name.find(name);
  if (it == r.by_name.end()) {
    throw std::logic_error(fmt::format("terse: codec '{}' is not registered (a codec is made by "
                                       "its registration's make())", name));
  }
  return it->second.id;
}

// What a spec can name: "name:key=value,..." splits at ':', ',' and '='.
bool valid_name(std::string_view name) {
  return !name.empty() && std::all_of(name.begin(), name.end(), [](char c) {
    return std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '-';
  });
}

}  // namespace

// Defined in error_feedback.cpp.
std::unique_ptr<Codec> wrap_error_feedback(std::unique_ptr<Codec> inner, double momentum);

bool register_codec(CodecInfo info) {
  if (!valid_name(info.name)) {
    throw InvalidArgument(fmt::format("terse: cannot register codec '{}' (id {}): a codec name is "
                                      "letters, digits, '_' and '-'", info.name, info.id));
  }
  if (!info.make) {
    throw InvalidArgument(fmt::format("terse: cannot register codec '{}' (id {}) without make()",
                                      info.name, info.id));
  }
  if (info.id == wire::kFailureId) {
    throw InvalidArgument(fmt::format("terse: cannot register codec '{}': id {} is reserved for "
                                      "the collectives' failure messages", info.name, info.id));
  }
  Registry& r = registry();
  std::lock_guard lock(r.mu);
  for (const auto& [name, other] : r.by_name) {
    if (name == info.name || other.id == info.id) {
      throw InvalidArgument(fmt::format(
          "terse: cannot register codec '{}' (id {}): codec '{}' (id {}) already has that {}",
          info.name, info.id, name, other.id, name == info.name ? "name" : "wire id"));
    }
  }
  std::string name = info.name;
  r.by_name.emplace(std::move(name), std::move(info));
  return true;
}

std::vector<CodecInfo> registered_codecs() {
  Registry& r = registry();
  std::lock_guard lock(r.mu);
  std::vector<CodecInfo> out;
  for (const auto& [name, info] : r.by_name) out.push_back(info);
  return out;
}

std::unique_ptr<Codec> make_codec(std::string_view text) {
  Spec spec = Spec::parse(text);
  CodecInfo info;
  {
    Registry& r = registry();
    std::lock_guard lock(r.mu);
    auto it = r.by_name.find(spec.name());
    if (it == r.by_name.end()) {
      std::vector<std::string> names;
      for (const auto& [n, i] : r.by_name) names.push_back(n);
      throw SpecError(fmt::format("terse: unknown codec '{}'; available: {}", spec.name(),
                                  fmt::join(names, ", ")));
    }
    info = it->second;
  }
  SpecReader reader(spec);
  bool ef = reader.take_flag("ef", false);
  // Error feedback's momentum correction (with ef=1 only: DGC has a momentum of its own).
  const double momentum =
      ef ? reader.take_number("momentum", 0.0, 0.0, 1.0, SpecReader::Ends::kRightOpen) : 0.0;
  std::unique_ptr<Codec> codec = info.make(reader);
  reader.finish();
  if (ef) {
    if (codec->traits().lossless) {
      throw SpecError(fmt::format("terse: ef=1 is meaningless for lossless codec '{}'",
                                  codec->name()));
    }
    if (codec->traits().multi_round || codec->traits().builtin_feedback) {
      // Round codecs (PowerSGD) and DGC keep their own residual; ef=1 would feed errors back
      // twice.
      throw SpecError(fmt::format("terse: '{}' has error feedback built in; ef=1 would apply it "
                                  "twice", codec->name()));
    }
    codec = wrap_error_feedback(std::move(codec), momentum);
  }
  return codec;
}

}  // namespace terse
