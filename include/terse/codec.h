// Gradient codecs: turn a span of fp32 values into bytes and back.
//
// A Codec is immutable after construction and safe to use from many threads at once. Anything
// that changes from call to call lives outside it: per-tensor state (error-feedback residuals,
// DGC momentum, PowerSGD's Q) in a CodecState the caller owns, and scratch memory in a
// Workspace the caller owns and reuses across calls.
//
// Every encoding starts with a header of Codec::kHeaderBytes bytes (laid out in src/codecs/wire.h)
// holding the codec id, a digest of its parameters, the element count and the payload length.
// decode() checks all of it and never reads or writes out of bounds, whatever bytes it is given:
// a bad payload raises DecodeError.
//
// A payload holding NaN or Inf values (which no encoder produces) is rejected the same way. When
// decode() throws, the destination's contents are unspecified: callers decode into their own
// buffers and copy results to the user's tensor only once every payload decoded.
//
// Non-finite input policy: encode() of any lossy codec throws InvalidArgument when the input
// holds NaN or +-Inf, naming the first offending index; the check is fused into the codec's
// own pass over the data. The lossless "none" codec applies the same rule so that every codec
// behaves alike.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "terse/dtype.h"
#include "terse/error.h"
#include "terse/export.h"
#include "terse/spec.h"

namespace terse {

struct CodecTraits {
  bool lossless = false;    // decode(encode(x)) == x bit for bit
  bool unbiased = false;    // E[decode(encode(x))] == x over the RNG
  bool summable = false;    // encodings of equal length add in the compressed domain (combine)
  bool stochastic = false;  // draws from the RNG keyed by EncodeContext
  bool stateful = false;    // make_state() returns state that must persist per tensor
  bool sparse = false;      // sends a subset of elements (indices or a shared-seed mask)
  bool multi_round = false;  // a RoundCodec: needs sums across ranks between its phases
  bool builtin_feedback = false;  // keeps what it did not send in its own state (DGC): no ef=1
};

enum class DecodeMode {
  kOverwrite,   // y = decoded
  kAccumulate,  // y += decoded
};

// Per-tensor state owned by the caller. save()/load() round-trip it exactly, so a resumed run
// continues bit for bit.
class TERSE_API CodecState {
 public:
  virtual ~CodecState() = default;
  virtual void save(std::vector<std::byte>& out) const = 0;
  // Throws DecodeError if the bytes were not produced by save() of the same kind and size.
  virtual void load(std::span<const std::byte> in) = 0;
  // Takes over from `previous`, this tensor's state under another spec (another ratio, rank or
  // bit width), what still applies here: error-feedback residuals and accumulators, which hold
  // gradient not yet sent whatever the spec. Returns false, this state untouched, when nothing
  // applies (another kind of state, another size). `previous` is left valid but unspecified.
  virtual bool adopt(CodecState& previous) {
    (void)previous;
    return false;
  }
};

// Reusable scratch memory. A codec asks for slot k of n elements of T; the memory stays
// allocated (and its pages touched) between calls, so hot paths do not pay for fresh pages.
// Not thread-safe: give each worker thread its own.
class TERSE_API Workspace {
 public:
  // Codecs use slots [0, kWrapperSlot); wrappers (error feedback) use kWrapperSlot and above,
  // so a wrapper's buffers survive the wrapped codec's use of its own.
  static constexpr std::size_t kWrapperSlot = 16;
  // The fp32 copy of a half-precision input (Codec::encode of 16-bit values), which both the
  // codec and its wrappers read while they use their own slots.
  static constexpr std::size_t kInputSlot = 24;

  template <typename T>
  std::span<T> get(std::size_t slot, std::size_t n) {
    static_assert(std::is_trivially_copyable_v<T>);
    std::byte* p = raw(slot, n * sizeof(T), alignof(T) > 64 ? alignof(T) : 64);
    return {reinterpret_cast<T*>(p), n};
  }

  // What each slot holds: bytes (0 for none), and how many times any slot has grown.
  std::size_t slots() const { return blocks_.size(); }
  std::size_t slot_bytes(std::size_t slot) const {
    return slot < blocks_.size() ? blocks_[slot].size() : 0;
  }
  std::uint64_t growths() const { return growths_; }
  // Grows a slot to at least `bytes` and touches every page of it, so that a later get() of
  // that slot, up to that size, neither allocates nor faults (the engine's idle workers do this
  // ahead of time: growing inside a run puts fresh memory's page faults on its critical path).
  void reserve(std::size_t slot, std::size_t bytes);

 private:
  std::byte* raw(std::size_t slot, std::size_t bytes, std::size_t align);
  struct Block {
    struct Free {  // blocks come from kit::allocate_bytes (huge pages when large)
      std::size_t bytes;  // what was asked for (large blocks are kept for reuse); 0 if none
      void operator()(std::byte* p) const noexcept;
    };
    std::unique_ptr<std::byte[], Free> data;
    std::size_t size() const { return data.get_deleter().bytes; }
  };
  void grow(Block& b, std::size_t bytes);  // replaces b's memory with `bytes` new bytes
  std::vector<Block> blocks_;
  std::uint64_t growths_ = 0;
};

struct TERSE_API EncodeContext {
  std::uint64_t seed = 0;    // shared by all ranks of a job
  std::uint64_t step = 0;    // training step (advances the RNG stream)
  std::uint64_t tensor = 0;  // stable id of the tensor, e.g. fnv1a64(name)
  std::uint64_t rank = 0;    // this rank; stochastic codecs mix it in unless told to share
  CodecState* state = nullptr;  // required when traits().stateful
  Workspace* workspace = nullptr;  // optional; codecs fall back to a thread-local one

  // The key of the RNG stream shared by all ranks for this (seed, step, tensor).
  std::uint64_t shared_key() const;
  // The key of this rank's own stream: independent noise on each rank.
  std::uint64_t rank_key() const;
  Workspace& scratch() const;
};

// What a payload header says, for callers that route payloads without decoding them.
struct PayloadInfo {
  std::uint8_t codec_id = 0;
  std::uint32_t param_digest = 0;
  std::uint64_t elements = 0;
  std::uint64_t payload_bytes = 0;  // after the header
};

class TERSE_API Codec {
 public:
  // Bytes of the header that starts every encoding, before the codec's own payload.
  static constexpr std::size_t kHeaderBytes = 24;

  virtual ~Codec() = default;
  Codec(const Codec&) = delete;
  Codec& operator=(const Codec&) = delete;

  const std::string& name() const { return name_; }
  // Canonical spec with every parameter: equal on all ranks iff they use the same codec.
  const std::string& spec() const { return spec_; }
  std::uint8_t id() const { return id_; }
  std::uint32_t param_digest() const { return digest_; }
  virtual CodecTraits traits() const = 0;

  // Upper bound on encode()'s output for n elements, header included.
  std::size_t max_encoded_bytes(std::size_t n) const;
  // Encodes x into out (at least max_encoded_bytes(x.size()) long); returns the bytes written.
  std::size_t encode(std::span<const float> x, std::span<std::byte> out,
                     EncodeContext& ctx) const;
  // Encodes 16-bit values of `dtype` (kFloat16 or kBFloat16; kFloat32 throws InvalidArgument):
  // the same bytes as encode() of the same values widened to fp32 (widening is exact), with the
  // same non-finite policy. Codecs for which reads_directly(dtype) is true read the 16-bit
  // values in their own pass; the others encode an fp32 copy made in the workspace
  // (Workspace::kInputSlot).
  std::size_t encode(std::span<const std::uint16_t> x, DType dtype, std::span<std::byte> out,
                     EncodeContext& ctx) const;
  // Whether encode() of 16-bit values of `dtype` does without an fp32 copy of the whole input
  // (it may widen a chunk at a time, in cache).
  virtual bool reads_directly(DType dtype) const {
    return dtype == DType::kFloat32;
  }
  // Decodes a payload of exactly y.size() elements into y. Throws DecodeError on anything the
  // encoder of this codec, with these parameters, could not have produced.
  void decode(std::span<const std::byte> in, std::span<float> y,
              DecodeMode mode = DecodeMode::kOverwrite) const;

  // Fresh per-tensor state for a tensor of n elements (null for stateless codecs).
  virtual std::unique_ptr<CodecState> make_state(std::size_t n) const;
  // Summable codecs: acc <- acc + in, both full encodings of this codec of the same tensor and
  // step. Throws InvalidArgument for codecs that are not summable.
  virtual void combine(std::span<const std::byte> in, std::span<std::byte> acc) const;

  // Reads and checks a header (magic, version, sizes) without decoding.
  static PayloadInfo peek(std::span<const std::byte> in);

 protected:
  // A codec made by its registration's make() from `reader`, once every parameter is read: its
  // name and wire id are those it was registered with (the registrar is the one place they are
  // written), its spec the reader's canonical one. Throws std::logic_error for a name no codec
  // registered.
  explicit Codec(const SpecReader& reader);
  // For wrappers that encode exactly like another codec (error feedback): same name, id and
  // digest, so their payloads decode with the wrapped codec, while spec() tells the two apart.
  Codec(const Codec& wrapped, std::string canonical_spec);

  virtual std::size_t max_payload_bytes(std::size_t n) const = 0;
  // x is finite-checked by the codec itself (see the policy above).
  virtual std::size_t encode_payload(std::span<const float> x, std::span<std::byte> out,
                                     EncodeContext& ctx) const = 0;
  // Half-precision input (dtype kFloat16 or kBFloat16); must write what encode_payload writes for
  // the widened values. The default widens x into the workspace and calls encode_payload.
  // Overrides that meet a NaN or Inf may call this default, which throws the usual error.
  virtual std::size_t encode_half_payload(std::span<const std::uint16_t> x, DType dtype,
                                          std::span<std::byte> out, EncodeContext& ctx) const;
  // in is exactly the payload the header announced; y has the announced element count.
  virtual void decode_payload(std::span<const std::byte> in, std::span<float> y,
                              DecodeMode mode) const = 0;

  // Checks a header for this codec and returns the payload; used by combine() overrides.
  std::span<const std::byte> checked_payload(std::span<const std::byte> in,
                                             std::size_t elements) const;
  // For decode_payload of a payload whose size the element count fixes: throws DecodeError
  // (naming this codec, both sizes and the elements) unless `in` holds `expected` bytes.
  void expect_payload_bytes(std::span<const std::byte> in, std::size_t elements,
                            std::size_t expected) const;

 private:
  std::string name_;
  std::string spec_;
  std::uint8_t id_;
  std::uint32_t digest_;

  void check_encode_args(std::size_t n, std::span<std::byte> out,
                         const EncodeContext& ctx) const;
  std::size_t write_header(std::size_t n, std::size_t payload, std::span<std::byte> out) const;

  Codec(std::string name, std::uint8_t id, std::string canonical_spec, std::uint32_t digest);

  friend class ErrorFeedbackCodec;  // runs the wrapped codec's payload coder directly
};

// Codecs whose compression needs the sum across ranks between phases (PowerSGD). The caller
// runs, for r = 0 .. rounds()-1: contribution = encode_round(r, x); sum the contributions of
// all ranks element-wise (they are plain fp32 arrays); absorb_round(r, sum). Then finish()
// writes the reconstructed sum of all ranks' inputs. On one rank the sum is the contribution.
class TERSE_API RoundCodec {
 public:
  virtual ~RoundCodec() = default;
  virtual int rounds() const = 0;
  // Elements of round r's contribution for a tensor of n elements.
  virtual std::size_t round_elements(int r, std::size_t n) const = 0;
  virtual void encode_round(int r, std::span<const float> x, std::span<float> contribution,
                            EncodeContext& ctx) const = 0;
  virtual void absorb_round(int r, std::span<const float> sum, EncodeContext& ctx) const = 0;
  virtual void finish(std::span<float> y, EncodeContext& ctx) const = 0;
  // The summable codec (fp16, bf16) that carries round r's sums for a tensor of n elements on
  // the wire, or null (the default) for exact fp32 sums on the raw ring. A wire codec halves
  // the round's bytes and its message steps run like the summable strategy's (N instead of
  // 2(N-1)); its rounding is part of the sum every rank absorbs, identical on all of them.
  virtual const Codec* round_wire(int r, std::size_t n) const {
    (void)r;
    (void)n;
    return nullptr;
  }
};

// ---- Registry ---------------------------------------------------------------------------

struct CodecInfo {
  std::string name;         // what specs name it by: letters, digits, '_' and '-'
  std::uint8_t id = 0;      // on the wire; unique, never reused. 0-127: terse's own codecs;
                            // 128-254: codecs built outside the tree (docs/writing-a-codec.md);
                            // 255: reserved (the collectives' failure messages)
  std::string summary;      // one line for `terse codecs` and error messages
  std::function<std::unique_ptr<Codec>(SpecReader&)> make;
};

// Called from each codec's own file through a static registrar (returns true, for initializing
// it). The registration is the only place a codec's name and wire id are written: the codec
// learns both from it (Codec(const SpecReader&)). Throws InvalidArgument, naming both codecs,
// when the name or the id is taken, and for an invalid name or a missing make().
TERSE_API bool register_codec(CodecInfo info);
// Builds a codec from a spec such as "topk:ratio=0.01" or "onebit:ef=1". Unknown names or keys
// throw SpecError listing what is allowed. "ef=1" wraps any lossy codec in error feedback.
TERSE_API std::unique_ptr<Codec> make_codec(std::string_view spec);
TERSE_API std::vector<CodecInfo> registered_codecs();  // sorted by name

}  // namespace terse
