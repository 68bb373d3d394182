// The codecs from Python: the registry (codecs, canonical_spec), the strategies' names, and
// terse.Codec, one stateless codec for single-process use.
#include <fmt/format.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "bindings.h"
#include "convert.h"
#include "terse/codec.h"
#include "terse/communicator.h"
#include "terse/error.h"
#include "terse/plan.h"
#include "terse/spec.h"

namespace terse::python {
namespace {
// One codec for single-process use: encode to bytes, decode, or both at once. The pipeline's
// delta compressor mirrors on the sender what the receiver decodes, so it needs exactly the
// bytes a Channel would send: deterministic codecs give the same bytes for the same input.
class PyCodec {
 public:
  explicit PyCodec(const std::string& spec) : codec_(make_codec(spec)) {
    if (codec_->traits().stateful || codec_->traits().multi_round) {
      throw InvalidArgument(fmt::format(
          "codec {}: keeps state between calls or needs sums across ranks; terse.Codec encodes "
          "single stateless messages",
          codec_->spec()));
    }
  }
  const Codec& get() const { return *codec_; }

  // Encodes x into this thread's reusable buffer (fresh pages cost ~10 us each here).
  std::span<const std::byte> encode(std::span<const float> x, const EncodeContext& context) const {
    thread_local std::vector<std::byte> buffer;
    const std::size_t cap = codec_->max_encoded_bytes(x.size());
    if (buffer.size() < cap) buffer.resize(cap);
    EncodeContext ctx = context;
    const std::size_t n = codec_->encode(x, std::span(buffer).first(cap), ctx);
    return std::span<const std::byte>(buffer).first(n);
  }

 private:
  std::unique_ptr<Codec> codec_;
};

EncodeContext make_context(std::uint64_t seed, std::uint64_t step, const std::string& tensor,
                           std::uint64_t rank) {
  EncodeContext ctx;
  ctx.seed = seed;
  ctx.step = step;
  ctx.tensor = tensor.empty() ? 0 : fnv1a64(tensor);
  ctx.rank = rank;
  return ctx;
}

}  // namespace

void bind_codec_functions(py::module_& m) {
  m.def(
      "codecs",
      [] {
        py::list out;
        for (const auto& c : registered_codecs()) {
          py::dict d;
          d["name"] = c.name;
          d["id"] = c.id;
          d["summary"] = c.summary;
          out.append(d);
        }
        return out;
      },
      "The registered codecs, sorted by name: dicts with name, id (on the wire) and summary.");
  m.def(
      "canonical_spec", [](const std::string& spec) { return make_codec(spec)->spec(); },
      py::arg("spec"),
      "The canonical form of a codec spec (every parameter, defaults included): equal on two "
      "ranks iff they use the same codec. Raises SpecError listing what is allowed.");
  m.def(
      "strategies",
      [] {
        std::vector<std::string> out;
        for (auto s : {Strategy::kAuto, Strategy::kRaw, Strategy::kAllgather, Strategy::kSharded,
                       Strategy::kRing, Strategy::kSummable, Strategy::kAllToAll}) {
          out.emplace_back(to_string(s));
        }
        return out;
      },
      "Names of the collective strategies (docs/design.md explains their costs).");
  m.def(
      "default_timeout", [] { return to_seconds(environment_timeout()); },
      "Seconds every wait is bounded by when no timeout is given: TERSE_TIMEOUT, else 60.");
}

void bind_codec(py::module_& m) {
  py::class_<PyCodec>(m, "Codec",
                      "One stateless codec for single-process use: encode a float32 tensor to "
                      "bytes, decode bytes, or both (roundtrip). Deterministic codecs give the "
                      "same bytes a Channel sends for the same input.")
      .def(py::init<const std::string&>(), py::arg("spec"))
      .def_property_readonly("name", [](const PyCodec& c) { return c.get().name(); })
      .def_property_readonly("spec", [](const PyCodec& c) { return c.get().spec(); },
                             "The canonical spec (every parameter).")
      .def_property_readonly(
          "traits",
          [](const PyCodec& c) {
            const CodecTraits t = c.get().traits();
            py::dict d;
            d["lossless"] = t.lossless;
            d["unbiased"] = t.unbiased;
            d["summable"] = t.summable;
            d["stochastic"] = t.stochastic;
            d["stateful"] = t.stateful;
            d["sparse"] = t.sparse;
            return d;
          },
          "What the codec promises (lossless, unbiased, summable, stochastic, stateful, sparse).")
      .def(
          "max_encoded_bytes", [](const PyCodec& c, std::size_t n) {
            return c.get().max_encoded_bytes(n);
          },
          py::arg("elements"), "Upper bound on an encoding of that many elements, header included.")
      .def(
          "encode",
          [](const PyCodec& c, py::object x, std::uint64_t seed, std::uint64_t step,
             const std::string& tensor, std::uint64_t rank) {
            const std::span<float> in = float_span(x, tensor.empty() ? "x" : tensor);
            std::span<const std::byte> bytes;
            {
              py::gil_scoped_release release;
              bytes = c.encode(in, make_context(seed, step, tensor, rank));
            }
            return py::bytes(reinterpret_cast<const char*>(bytes.data()), bytes.size());
          },
          py::arg("x"), py::arg("seed") = 0, py::arg("step") = 0, py::arg("tensor") = "",
          py::arg("rank") = 0,
          "The encoding of x (header included). seed, step, tensor (a name) and rank key "
          "stochastic codecs' random streams as the engine and the Channel do.")
      .def(
          "decode",
          [](const PyCodec& c, py::buffer payload, py::object out) {
            py::buffer_info info = payload.request();
            const std::span<const std::byte> bytes(
                static_cast<const std::byte*>(info.ptr),
                static_cast<std::size_t>(info.size) * static_cast<std::size_t>(info.itemsize));
            const std::span<float> y = float_span(out, "out");
            py::gil_scoped_release release;
            c.get().decode(bytes, y);
          },
          py::arg("payload"), py::arg("out"),
          "Decodes payload into out (exactly its element count); raises DecodeError on bytes "
          "this codec could not have produced.")
      .def(
          "roundtrip",
          [](const PyCodec& c, py::object x, py::object out, std::uint64_t seed,
             std::uint64_t step, const std::string& tensor, std::uint64_t rank) {
            const std::span<float> in = float_span(x, tensor.empty() ? "x" : tensor);
            const std::span<float> y = float_span(out, "out");
            if (y.size() != in.size()) {
              throw InvalidArgument(fmt::format("roundtrip: out has {} elements, x has {}",
                                                y.size(), in.size()));
            }
            py::gil_scoped_release release;
            const std::span<const std::byte> bytes =
                c.encode(in, make_context(seed, step, tensor, rank));
            c.get().decode(bytes, y);
            return bytes.size();
          },
          py::arg("x"), py::arg("out"), py::arg("seed") = 0, py::arg("step") = 0,
          py::arg("tensor") = "", py::arg("rank") = 0,
          "out = decode(encode(x)) (out may be x); returns the encoding's size in bytes.");
}

}  // namespace terse::python
