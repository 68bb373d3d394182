// terse._C: the Python binding of terse's public C++ API (codecs, stores, Communicator, Engine,
// the point-to-point Channel).
// The pure-Python package terse re-exports it; terse.torch builds the DDP hook on top.
//
// Tensors are borrowed zero-copy: a contiguous float32 CPU torch.Tensor (float16 and bfloat16
// too, for the engine) is read through its data_ptr() and numel() (so the module does not link
// libtorch, whose C++ ABI is tied to one torch build), any other object through the buffer
// protocol (numpy arrays of float32, or float16 for the engine; array('f')). The
// binding keeps every submitted object alive until its submission completes.
//
// GIL: released around every call that can block or talk to other ranks (communicator creation,
// barrier, submission, whose first-use check exchanges messages, wait, synchronize, state
// save/load, engine shutdown). Engine threads take it only to run Python callbacks and to drop
// references, so a thread that holds the GIL while waiting for the engine would deadlock; the
// binding never does.
#include <fmt/format.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <memory>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <vector>

#include "errors.h"
#include "gil.h"
#include "python_store.h"
#include "terse/channel.h"
#include "terse/codec.h"
#include "terse/communicator.h"
#include "terse/engine.h"
#include "terse/environment.h"
#include "terse/error.h"
#include "terse/planner.h"

namespace terse::python {
namespace {

using std::chrono::milliseconds;

// Seconds from Python (None: the default, TERSE_TIMEOUT or 60 s) to the C++ convention, where
// zero means the default.
milliseconds to_timeout(std::optional<double> seconds) {
  if (!seconds) return milliseconds(0);
  if (!std::isfinite(*seconds) || *seconds <= 0) {
    throw InvalidArgument(
        fmt::format("timeout must be a positive number of seconds, not {}", *seconds));
  }
  return milliseconds(static_cast<std::int64_t>(std::ceil(*seconds * 1000)));
}
// The environment's timeout (TERSE_TIMEOUT), else default_timeout().
milliseconds environment_timeout() {
  const milliseconds t = communicator_options_from_environment().timeout;
  return t.count() > 0 ? t : default_timeout();
}
milliseconds resolved_timeout(std::optional<double> seconds) {
  const milliseconds t = to_timeout(seconds);
  return t.count() > 0 ? t : environment_timeout();
}
double to_seconds(milliseconds t) { return static_cast<double>(t.count()) / 1000.0; }

std::string type_name(py::handle obj) {
  return py::type::of(obj).attr("__name__").cast<std::string>();
}

// ---- borrowing tensors ----------------------------------------------------------------------

constexpr const char* kEngineDtypes = "torch.float32, torch.float16 and torch.bfloat16";

// dtypes the engine reduces (float32 only where `half` is false).
TensorView torch_tensor_view(py::handle tensor, const std::string& name, bool half) {
  // torch's dtypes, looked up once and kept for the life of the process (no destructor at exit).
  static PyObject* float32 =
      py::object(py::module_::import("torch").attr("float32")).release().ptr();
  static PyObject* float16 =
      py::object(py::module_::import("torch").attr("float16")).release().ptr();
  static PyObject* bfloat16 =
      py::object(py::module_::import("torch").attr("bfloat16")).release().ptr();
  py::object dtype = tensor.attr("dtype");
  DType type = DType::kFloat32;
  if (half && dtype.is(py::handle(float16))) {
    type = DType::kFloat16;
  } else if (half && dtype.is(py::handle(bfloat16))) {
    type = DType::kBFloat16;
  } else if (!dtype.is(py::handle(float32))) {
    throw py::type_error(fmt::format("tensor '{}': dtype is {}, terse reduces {}", name,
                                     std::string(py::str(dtype)),
                                     half ? kEngineDtypes : "torch.float32"));
  }
  const auto device = tensor.attr("device").attr("type").cast<std::string>();
  if (device != "cpu") {
    throw InvalidArgument(
        fmt::format("tensor '{}' is on {}; terse reduces CPU tensors", name, device));
  }
  if (!tensor.attr("is_contiguous")().cast<bool>()) {
    throw InvalidArgument(
        fmt::format("tensor '{}' is not contiguous; pass .contiguous() and "
                    "copy the result back",
                    name));
  }
  const auto n = tensor.attr("numel")().cast<std::size_t>();
  const auto address = tensor.attr("data_ptr")().cast<std::uintptr_t>();
  return TensorView(n == 0 ? nullptr : reinterpret_cast<void*>(address), n, type);
}

TensorView buffer_view(py::handle obj, const std::string& name, bool half) {
  py::buffer_info info;
  try {
    info = py::reinterpret_borrow<py::buffer>(obj).request(/*writable=*/true);
  } catch (py::error_already_set& e) {
    // Results are written in place, so a read-only buffer cannot take part.
    throw InvalidArgument(fmt::format("tensor '{}': not a writable buffer ({})", name, e.what()));
  }
  const std::string& f = info.format;
  const bool is_float = info.itemsize == 4 && (f == "f" || f == "<f" || f == "=f" || f == "@f");
  const bool is_half =
      half && info.itemsize == 2 && (f == "e" || f == "<e" || f == "=e" || f == "@e");
  if (!is_float && !is_half) {
    throw py::type_error(fmt::format("tensor '{}': buffer holds '{}' items of {} bytes, terse "
                                     "reduces {}",
                                     name, f, info.itemsize,
                                     half ? "float32 and float16" : "float32"));
  }
  py::ssize_t expected = info.itemsize;
  for (py::ssize_t d = info.ndim - 1; d >= 0; --d) {
    if (info.shape[d] > 1 && info.strides[d] != expected) {
      throw InvalidArgument(fmt::format("tensor '{}': buffer is not C-contiguous", name));
    }
    expected *= info.shape[d];
  }
  return TensorView(info.size == 0 ? nullptr : info.ptr, static_cast<std::size_t>(info.size),
                    is_half ? DType::kFloat16 : DType::kFloat32);
}

// A tensor for the engine: float32, float16 or bfloat16.
TensorView tensor_view(py::handle obj, const std::string& name) {
  if (py::hasattr(obj, "data_ptr") && py::hasattr(obj, "numel")) {
    return torch_tensor_view(obj, name, true);
  }
  if (PyObject_CheckBuffer(obj.ptr()) != 0) return buffer_view(obj, name, true);
  throw py::type_error(fmt::format("tensor '{}': expected a torch.Tensor ({}) or a writable "
                                   "float32 or float16 buffer, got {}",
                                   name, kEngineDtypes, type_name(obj)));
}

std::span<float> float_span(py::handle obj, const std::string& name) {
  if (py::hasattr(obj, "data_ptr") && py::hasattr(obj, "numel")) {
    return torch_tensor_view(obj, name, false).floats();
  }
  if (PyObject_CheckBuffer(obj.ptr()) != 0) return buffer_view(obj, name, false).floats();
  throw py::type_error(
      fmt::format("tensor '{}': expected a float32 torch.Tensor or a writable "
                  "float32 buffer, got {}",
                  name, type_name(obj)));
}

DType parse_dtype(py::handle dtype) {
  std::string s = py::str(dtype);
  if (s.rfind("torch.", 0) == 0) s = s.substr(6);
  if (s == "float32" || s == "float") return DType::kFloat32;
  if (s == "float16" || s == "half") return DType::kFloat16;
  if (s == "bfloat16") return DType::kBFloat16;
  throw py::type_error(fmt::format("dtype {} is not one terse reduces ({})", s, kEngineDtypes));
}

// ---- handles --------------------------------------------------------------------------------

class PyHandle {
 public:
  PyHandle(Handle handle, py::list borrowed)
      : handle_(std::move(handle)), borrowed_(std::make_shared<PythonRef>(std::move(borrowed))) {
    // The engine may write into the tensors until the submission completes, even if Python
    // drops this handle first: the completion callback holds them until then.
    handle_.on_complete([keep = borrowed_](std::exception_ptr) {});
  }

  void wait() const {
    py::gil_scoped_release release;
    handle_.wait();
  }
  bool ready() const { return handle_.ready(); }

  void on_complete(py::function f) const {
    auto callback = std::make_shared<PythonRef>(std::move(f));
    handle_.on_complete([callback](std::exception_ptr error) {
      py::gil_scoped_acquire gil;
      try {
        callback->get()(error ? to_python_error(error) : py::none());
      } catch (py::error_already_set& e) {
        // Nobody up this (engine) thread's stack could handle it: report it like Python does
        // for exceptions in __del__ and carry on.
        e.discard_as_unraisable("terse: Handle.on_complete callback");
      }
    });
  }

 private:
  Handle handle_;
  std::shared_ptr<PythonRef> borrowed_;
};

// ---- the engine -----------------------------------------------------------------------------

AllreduceOptions make_options(std::string codec, const std::string& strategy, int partitions,
                              bool average, std::size_t rows = 0) {
  AllreduceOptions o;
  o.codec = std::move(codec);
  o.strategy = parse_strategy(strategy);
  o.partitions = partitions;
  o.average = average;
  o.rows = rows;
  return o;
}

class PyEngine;
// Engines still open, closed by an atexit hook: their worker threads must be gone before the
// interpreter finalizes, since a callback taking the GIL then would crash. Guarded by the GIL.
std::set<PyEngine*>& open_engines() {
  static auto* engines = new std::set<PyEngine*>();
  return *engines;
}

class PyEngine {
 public:
  PyEngine(std::shared_ptr<Communicator> comm, const EngineOptions& options) : comm_(comm) {
    std::unique_ptr<Engine> engine;
    {
      py::gil_scoped_release release;
      engine =
          std::make_unique<Engine>(std::move(comm), engine_options_from_environment(options));
    }
    engine_ = share_releasing_gil(std::move(engine));
    open_engines().insert(this);
  }
  ~PyEngine() {
    open_engines().erase(this);
    close();
  }
  PyEngine(const PyEngine&) = delete;
  PyEngine& operator=(const PyEngine&) = delete;

  // Waits for every submission (each bounded by the timeout) and stops the worker threads. The
  // deleter releases the GIL meanwhile, so completion callbacks still waiting for it can run.
  void close() { engine_.reset(); }
  bool closed() const { return !engine_; }

  std::shared_ptr<Engine> get() const {
    if (!engine_) throw InvalidArgument("engine: used after close()");
    return engine_;
  }
  const std::shared_ptr<Communicator>& communicator() const { return comm_; }

  PyHandle allreduce(std::string name, py::object data, std::string codec,
                     const std::string& strategy, int partitions, bool average) {
    auto engine = get();
    AllreduceOptions options = make_options(std::move(codec), strategy, partitions, average);
    const TensorView view = tensor_view(data, name);
    py::list borrowed;
    borrowed.append(data);
    Handle handle;
    {
      py::gil_scoped_release release;
      handle = engine->allreduce(std::move(name), view, std::move(options));
    }
    return PyHandle(std::move(handle), std::move(borrowed));
  }

  // reduce_scatter, all_gather, all_to_all: both tensors borrowed until the handle completes.
  PyHandle collective(const char* op, std::string name, py::object input, py::object output,
                      std::vector<std::size_t> send_counts, std::vector<std::size_t> recv_counts,
                      std::string codec, const std::string& strategy, int partitions,
                      bool average) {
    auto engine = get();
    CollectiveOptions options;
    options.codec = std::move(codec);
    options.strategy = parse_strategy(strategy);
    options.partitions = partitions;
    options.average = average;
    const TensorView in = tensor_view(input, name);
    const TensorView out = tensor_view(output, name);
    py::list borrowed;
    borrowed.append(input);
    borrowed.append(output);
    const std::string which = op;
    Handle handle;
    {
      py::gil_scoped_release release;
      if (which == "reduce_scatter") {
        handle = engine->reduce_scatter(std::move(name), in, out, std::move(options));
      } else if (which == "all_gather") {
        handle = engine->all_gather(std::move(name), in, out, std::move(options));
      } else {
        handle = engine->all_to_all(std::move(name), in, send_counts, out, recv_counts,
                                    std::move(options));
      }
    }
    return PyHandle(std::move(handle), std::move(borrowed));
  }

  PyHandle allreduce_group(py::iterable items) {
    auto engine = get();
    std::vector<TensorRef> refs;
    py::list borrowed;
    for (py::handle item : items) {
      const py::tuple t(py::reinterpret_borrow<py::object>(item));
      if (t.size() != 2 && t.size() != 3) {
        throw py::type_error(
            "allreduce_group: each item is (name, tensor) or (name, tensor, "
            "AllreduceOptions)");
      }
      TensorRef ref;
      ref.name = t[0].cast<std::string>();
      ref.typed = tensor_view(t[1], ref.name);
      if (t.size() == 3 && !t[2].is_none()) ref.options = t[2].cast<AllreduceOptions>();
      borrowed.append(t[1]);
      refs.push_back(std::move(ref));
    }
    Handle handle;
    {
      py::gil_scoped_release release;
      handle = engine->allreduce_group(std::move(refs));
    }
    return PyHandle(std::move(handle), std::move(borrowed));
  }

 private:
  std::shared_ptr<Communicator> comm_;
  std::shared_ptr<Engine> engine_;
};

// ---- codecs ---------------------------------------------------------------------------------

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

// ---- the channel ----------------------------------------------------------------------------

class PyChannel;
// Channels still open, closed at interpreter exit like engines (their completion threads take
// the GIL to drop references). Guarded by the GIL.
std::set<PyChannel*>& open_channels() {
  static auto* channels = new std::set<PyChannel*>();
  return *channels;
}

class PyChannel {
 public:
  PyChannel(std::shared_ptr<Communicator> comm, std::uint64_t seed) : comm_(comm) {
    ChannelOptions options;
    options.seed = seed;
    channel_ = share_releasing_gil(std::make_unique<Channel>(std::move(comm), options));
    open_channels().insert(this);
  }
  ~PyChannel() {
    open_channels().erase(this);
    close();
  }
  PyChannel(const PyChannel&) = delete;
  PyChannel& operator=(const PyChannel&) = delete;

  // Waits for the pending messages (each bounded by the timeout) and joins the threads.
  void close() { channel_.reset(); }
  bool closed() const { return !channel_; }
  std::shared_ptr<Channel> get() const {
    if (!channel_) throw InvalidArgument("channel: used after close()");
    return channel_;
  }
  const std::shared_ptr<Communicator>& communicator() const { return comm_; }

  PyHandle send(int peer, const std::string& name, py::object tensor, const std::string& codec) {
    auto channel = get();
    const std::span<float> x = float_span(tensor, name);
    Handle handle;
    {
      py::gil_scoped_release release;
      handle = channel->send(peer, name, x, codec);
    }
    // The payload is a copy: the tensor is free again, so the handle borrows nothing.
    return PyHandle(std::move(handle), py::list());
  }

  PyHandle recv(int peer, const std::string& name, py::object tensor, const std::string& codec) {
    auto channel = get();
    const std::span<float> out = float_span(tensor, name);
    py::list borrowed;
    borrowed.append(tensor);
    Handle handle;
    {
      py::gil_scoped_release release;
      handle = channel->recv(peer, name, out, codec);
    }
    return PyHandle(std::move(handle), std::move(borrowed));
  }

 private:
  std::shared_ptr<Communicator> comm_;
  std::shared_ptr<Channel> channel_;
};

std::string options_repr(const AllreduceOptions& o) {
  return fmt::format("AllreduceOptions(codec='{}', strategy='{}', partitions={}, average={}{})",
                     o.codec, to_string(o.strategy), o.partitions, o.average ? "True" : "False",
                     o.rows > 0 ? fmt::format(", rows={}", o.rows) : std::string());
}

void bind(py::module_& m) {
  m.doc() = "terse's C++ core: codecs, stores, Communicator and the allreduce Engine.";
  m.attr("__version__") = TERSE_VERSION;
  register_errors(m);

  // ---- codecs -------------------------------------------------------------------------------
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

  // ---- stores -------------------------------------------------------------------------------
  py::class_<Store, std::shared_ptr<Store>>(
      m, "Store",
      "A key-value store every rank reaches, used only to bootstrap connections. Keys are set "
      "once per job.")
      .def(
          "set",
          [](Store& s, const std::string& key, py::bytes value) {
            std::string v = value;
            py::gil_scoped_release release;
            s.set(key, std::as_bytes(std::span(v.data(), v.size())));
          },
          py::arg("key"), py::arg("value"))
      .def(
          "get",
          [](Store& s, const std::string& key, std::optional<double> timeout) {
            std::vector<std::byte> v;
            {
              py::gil_scoped_release release;
              v = s.get(key, resolved_timeout(timeout));
            }
            return py::bytes(reinterpret_cast<const char*>(v.data()), v.size());
          },
          py::arg("key"), py::arg("timeout") = py::none(),
          "The value of key, waiting up to timeout seconds for some rank to set it.")
      .def(
          "wait",
          [](Store& s, const std::vector<std::string>& keys, std::optional<double> timeout) {
            py::gil_scoped_release release;
            s.wait(keys, resolved_timeout(timeout));
          },
          py::arg("keys"), py::arg("timeout") = py::none())
      .def_property_readonly(
          "port", [](const Store& s) { return tcp_store_port(s); },
          "The TCP store's port; -1 for other stores.");
  m.def("file_store", &make_file_store, py::arg("directory"),
        "A store in a directory every rank sees (use a fresh directory per job).");
  m.def(
      "tcp_store",
      [](const std::string& host, int port, bool is_server, std::optional<double> timeout) {
        py::gil_scoped_release release;
        return make_tcp_store(host, port, is_server, resolved_timeout(timeout));
      },
      py::arg("host"), py::arg("port"), py::arg("is_server"), py::arg("timeout") = py::none(),
      "A TCP store served by one process (is_server; port 0 picks a free one) and used by all.");
  m.def("prefix_store", &make_prefix_store, py::arg("prefix"), py::arg("store"),
        "A view of store whose keys all start with prefix + '/'.");
  m.def("python_store", &make_python_store, py::arg("store"),
        "Adapts a torch.distributed.Store (or any object with set(key, bytes), get(key) -> bytes "
        "and wait(keys, timedelta)) to terse.");
  m.def(
      "bootstrap_from_env",
      [](std::optional<double> timeout) {
        Bootstrap b;
        {
          py::gil_scoped_release release;
          b = bootstrap_from_env(resolved_timeout(timeout));
        }
        return py::make_tuple(b.rank, b.size, b.store);
      },
      py::arg("timeout") = py::none(),
      "(rank, size, store) from torchrun's environment: RANK, WORLD_SIZE and TERSE_FILE_STORE or "
      "MASTER_ADDR/MASTER_PORT (rank 0 then serves a TCP store on MASTER_PORT). The store is "
      "made once per process and shared by every later call and by Communicator.from_env.");

  // ---- communicator -------------------------------------------------------------------------
  auto make_comm_options = [](std::optional<double> timeout, std::string interface,
                              std::string hostname, std::string prefix) {
    CommunicatorOptions o;
    o.timeout = to_timeout(timeout);
    o.interface = std::move(interface);
    o.hostname = std::move(hostname);
    o.prefix = std::move(prefix);
    return communicator_options_from_environment(std::move(o));
  };
  py::class_<Communicator, std::shared_ptr<Communicator>>(
      m, "Communicator",
      "A fully connected group of processes over Gloo TCP. Every wait is bounded by timeout; "
      "after any failure the communicator is failed for good and peers learn it promptly.")
      .def(py::init([make_comm_options](int rank, int size, std::shared_ptr<Store> store,
                                        std::optional<double> timeout, std::string interface,
                                        std::string hostname, std::string prefix) {
             auto options = make_comm_options(timeout, std::move(interface), std::move(hostname),
                                              std::move(prefix));
             std::unique_ptr<Communicator> comm;
             {
               py::gil_scoped_release release;
               comm = Communicator::create(rank, size, std::move(store), std::move(options));
             }
             return share_releasing_gil(std::move(comm));
           }),
           py::arg("rank"), py::arg("size"), py::arg("store"), py::arg("timeout") = py::none(),
           py::arg("interface") = "", py::arg("hostname") = "", py::arg("prefix") = "terse",
           "Connects to every other rank through store (collective: every rank calls it with the "
           "same size and prefix). timeout: seconds (None: TERSE_TIMEOUT, else 60). interface: "
           "network interface to bind (None: TERSE_IFNAME, GLOO_SOCKET_IFNAME, else hostname).")
      .def_static(
          "from_env",
          [make_comm_options](std::optional<double> timeout, std::string interface,
                              std::string hostname, std::string prefix) {
            auto options = make_comm_options(timeout, std::move(interface), std::move(hostname),
                                             std::move(prefix));
            std::unique_ptr<Communicator> comm;
            {
              py::gil_scoped_release release;
              comm = Communicator::from_env(std::move(options));
            }
            return share_releasing_gil(std::move(comm));
          },
          py::arg("timeout") = py::none(), py::arg("interface") = "", py::arg("hostname") = "",
          py::arg("prefix") = "terse",
          "Bootstraps from torchrun's environment (see bootstrap_from_env).")
      .def_property_readonly("rank", &Communicator::rank)
      .def_property_readonly("size", &Communicator::size)
      .def_property_readonly(
          "timeout", [](const Communicator& c) { return to_seconds(c.timeout()); },
          "Seconds every wait is bounded by.")
      .def_property_readonly("address", &Communicator::address)
      .def_property_readonly("failed", &Communicator::failed)
      .def(
          "barrier",
          [](Communicator& c, const std::string& label) {
            py::gil_scoped_release release;
            c.barrier(label);
          },
          py::arg("label") = "")
      .def(
          "abort",
          [](Communicator& c, const std::string& reason) {
            py::gil_scoped_release release;  // it may wait briefly for its notices to leave
            c.abort(reason);
          },
          py::arg("reason"),
          "Fails the communicator now: pending and later operations here raise TransportError "
          "with reason, and peers blocked on this rank fail promptly.");

  // ---- options and plans --------------------------------------------------------------------
  py::class_<AllreduceOptions>(m, "AllreduceOptions",
                               "How one tensor is reduced: codec spec (or 'auto', 'auto:heavy': "
                               "the planner's choice), strategy, partitions (0: from the size), "
                               "average (divide by ranks) and rows (the tensor's first "
                               "dimension, 0: not given: a matrix codec that 'auto' chooses "
                               "views the tensor as rows x n/rows).")
      .def(py::init(&make_options), py::arg("codec") = "none", py::arg("strategy") = "auto",
           py::arg("partitions") = 0, py::arg("average") = true, py::arg("rows") = 0)
      .def_readwrite("codec", &AllreduceOptions::codec)
      .def_property(
          "strategy", [](const AllreduceOptions& o) { return std::string(to_string(o.strategy)); },
          [](AllreduceOptions& o, const std::string& s) { o.strategy = parse_strategy(s); })
      .def_readwrite("partitions", &AllreduceOptions::partitions)
      .def_readwrite("average", &AllreduceOptions::average)
      .def_readwrite("rows", &AllreduceOptions::rows)
      .def("__repr__", &options_repr);

  py::class_<TensorPlan>(m, "TensorPlan", "What the engine does with a tensor.")
      .def_readonly("codec", &TensorPlan::codec, "Canonical codec spec ('none': raw fp32).")
      .def_property_readonly("strategy",
                             [](const TensorPlan& p) { return std::string(to_string(p.strategy)); })
      .def_readonly("partitions", &TensorPlan::partitions)
      .def_readonly("fused", &TensorPlan::fused)
      .def("__repr__", [](const TensorPlan& p) {
        return fmt::format("TensorPlan(codec='{}', strategy='{}', partitions={})", p.codec,
                           to_string(p.strategy), p.partitions);
      });

  py::class_<EngineOptions>(m, "EngineOptions",
                            "Engine-wide settings (see include/terse/engine.h).")
      .def(py::init([](std::uint64_t seed, int threads, std::size_t fuse_bytes,
                       std::size_t partition_bytes, std::size_t gather_bytes,
                       bool keep_input_on_error, std::vector<std::string> auto_codecs,
                       std::vector<std::string> heavy_codecs) {
             EngineOptions o;
             o.seed = seed;
             o.threads = threads;
             o.fuse_bytes = fuse_bytes;
             o.partition_bytes = partition_bytes;
             o.gather_bytes = gather_bytes;
             o.keep_input_on_error = keep_input_on_error;
             if (!auto_codecs.empty() || !heavy_codecs.empty()) {  // validates the specs
               PlannerOptions po;
               po.allowed = std::move(auto_codecs);
               po.heavy = std::move(heavy_codecs);
               o.planner = std::make_shared<Planner>(planner_options_from_environment(po));
             }
             return o;
           }),
           py::arg("seed") = 0, py::arg("threads") = 0,
           py::arg("fuse_bytes") = EngineOptions{}.fuse_bytes,
           py::arg("partition_bytes") = EngineOptions{}.partition_bytes,
           py::arg("gather_bytes") = EngineOptions{}.gather_bytes,
           py::arg("keep_input_on_error") = false,
           py::arg("auto_codecs") = std::vector<std::string>{},
           py::arg("heavy_codecs") = std::vector<std::string>{},
           "auto_codecs: the light tier, the codecs codec='auto' may choose from (empty: "
           "TERSE_PLAN_CODECS, else fp16 and minmax8:ef=1; ['none']: raw only). heavy_codecs: "
           "the heavy tier, which codec='auto:heavy' may choose from as well (empty: "
           "TERSE_PLAN_HEAVY_CODECS, else onebit:ef=1 and powersgd; ['none']: none).")
      .def_property_readonly(
          "auto_codecs",
          [](const EngineOptions& o) {
            return o.planner ? o.planner->allowed() : std::vector<std::string>{};
          },
          "The canonical specs codec='auto' chooses from ([]: the default set).")
      .def_property_readonly(
          "heavy_codecs",
          [](const EngineOptions& o) {
            return o.planner ? o.planner->heavy() : std::vector<std::string>{};
          },
          "The canonical specs codec='auto:heavy' adds to auto_codecs ([]: the default set).")
      .def_readwrite("seed", &EngineOptions::seed, "Seed of stochastic codecs, equal on all ranks.")
      .def_readwrite("threads", &EngineOptions::threads,
                     "Worker threads (0: TERSE_THREADS, else 4).")
      .def_readwrite("fuse_bytes", &EngineOptions::fuse_bytes,
                     "Raw tensors of a group up to this size travel in one fused message.")
      .def_readwrite("partition_bytes", &EngineOptions::partition_bytes,
                     "Target partition size when a tensor's partitions is 0.")
      .def_readwrite("gather_bytes", &EngineOptions::gather_bytes,
                     "Raw messages whose (ranks - 1) copies fit in this many bytes are gathered "
                     "(one message step) instead of ringed; 0 always rings.")
      .def_readwrite("keep_input_on_error", &EngineOptions::keep_input_on_error,
                     "Stage results so a failed submission leaves the tensors unchanged.");

  // ---- engine -------------------------------------------------------------------------------
  py::class_<PyHandle>(m, "Handle", "The outcome of a submission.")
      .def("wait", &PyHandle::wait,
           "Blocks (without the GIL) until the submission completed; raises its error. Bounded "
           "by the communicator's timeout.")
      .def("ready", &PyHandle::ready)
      .def("on_complete", &PyHandle::on_complete, py::arg("callback"),
           "Calls callback(error) once the submission completed (error is None on success): at "
           "once if it already has, else on an engine thread holding the GIL. The callback must "
           "not wait for the engine.");

  py::class_<PyEngine>(m, "Engine",
                       "Asynchronous compression-aware allreduce (and reduce-scatter, all-gather, "
                       "all-to-all) of named float32, float16 and bfloat16 tensors. Every "
                       "rank must submit the same tensors with the same options in the same "
                       "order; results are written in place and are bit-identical on all ranks.")
      .def(py::init<std::shared_ptr<Communicator>, const EngineOptions&>(), py::arg("comm"),
           py::arg("options") = EngineOptions{})
      .def("allreduce", &PyEngine::allreduce, py::arg("name"), py::arg("tensor"),
           py::arg("codec") = "none", py::arg("strategy") = "auto", py::arg("partitions") = 0,
           py::arg("average") = true,
           "Starts an allreduce of one tensor (a contiguous CPU torch.Tensor of float32, float16 "
           "or bfloat16, or a float32 or float16 buffer; 16-bit tensors are reduced in fp32 a "
           "partition at a time and rounded once); "
           "returns a Handle. Raises at once for invalid options.")
      .def(
          "reduce_scatter",
          [](PyEngine& e, std::string name, py::object input, py::object output,
             std::string codec, const std::string& strategy, int partitions, bool average) {
            return e.collective("reduce_scatter", std::move(name), std::move(input),
                                std::move(output), {}, {}, std::move(codec), strategy,
                                partitions, average);
          },
          py::arg("name"), py::arg("input"), py::arg("output"), py::arg("codec") = "none",
          py::arg("strategy") = "auto", py::arg("partitions") = 0, py::arg("average") = true,
          "Starts a reduce-scatter; returns a Handle. input holds world size x n float32 "
          "elements (rank r's shard at [r*n, (r+1)*n)); output (n elements) receives the sum over "
          "ranks of this rank's shard, divided by the world size when average. Strategies: "
          "'raw' (codec 'none': the fp32 rank-order sum), 'alltoall' (the default for a codec: "
          "each contribution quantized once, as ZeRO++'s qgZ), 'sharded', 'ring', 'summable' "
          "(the allreduce's halves: its result for the shard). Error feedback is kept per "
          "shard. codec 'auto': the planner's choice of raw or an allowed codec (EngineOptions' "
          "auto_codecs), strategy and partitions for this size. Raises at once for sizes or "
          "options it cannot honour.")
      .def(
          "all_gather",
          [](PyEngine& e, std::string name, py::object input, py::object output,
             std::string codec, const std::string& strategy, int partitions) {
            return e.collective("all_gather", std::move(name), std::move(input),
                                std::move(output), {}, {}, std::move(codec), strategy,
                                partitions, false);
          },
          py::arg("name"), py::arg("input"), py::arg("output"), py::arg("codec") = "none",
          py::arg("strategy") = "auto", py::arg("partitions") = 0,
          "Starts an all-gather; returns a Handle. input holds this rank's shard of n elements "
          "(float32, float16 or bfloat16; it may be a view of output's own shard); output "
          "(world size x n elements, same dtype) receives rank r's shard at [r*n, (r+1)*n). "
          "With a lossy codec each shard is encoded once by its owner and every rank decodes "
          "the same bytes: every rank's output is bit-identical. codec 'auto': the planner's "
          "choice of raw or an allowed codec (EngineOptions' auto_codecs) for this size.")
      .def(
          "all_to_all",
          [](PyEngine& e, std::string name, py::object input,
             std::vector<std::size_t> send_counts, py::object output,
             std::vector<std::size_t> recv_counts, std::string codec,
             const std::string& strategy, int partitions) {
            return e.collective("all_to_all", std::move(name), std::move(input),
                                std::move(output), std::move(send_counts),
                                std::move(recv_counts), std::move(codec), strategy, partitions,
                                false);
          },
          py::arg("name"), py::arg("input"), py::arg("send_counts"), py::arg("output"),
          py::arg("recv_counts"), py::arg("codec") = "none", py::arg("strategy") = "auto",
          py::arg("partitions") = 0,
          "Starts an all-to-all; returns a Handle. input is split into send_counts[p] elements "
          "for rank p (in rank order); output receives recv_counts[p] elements from rank p. "
          "Uneven splits and zeros allowed; counts may change between calls, but rank q's "
          "send_counts[r] must equal rank r's recv_counts[q] (else MismatchError on every "
          "rank). With a lossy codec each block is encoded once by its sender.")
      .def("allreduce_group", &PyEngine::allreduce_group, py::arg("items"),
           "Starts one submission of (name, tensor[, AllreduceOptions]) items, e.g. a DDP "
           "bucket: small raw tensors travel fused, the others per their codec.")
      .def(
          "plan",
          [](PyEngine& e, std::size_t elements, std::string codec, const std::string& strategy,
             int partitions, bool average, py::object dtype, std::size_t rows) {
            auto engine = e.get();
            const AllreduceOptions options =
                make_options(std::move(codec), strategy, partitions, average, rows);
            const DType type = dtype.is_none() ? DType::kFloat32 : parse_dtype(dtype);
            py::gil_scoped_release release;  // codec "auto": the first call calibrates
            return engine->plan(elements, options, type);
          },
          py::arg("elements"), py::arg("codec") = "none", py::arg("strategy") = "auto",
          py::arg("partitions") = 0, py::arg("average") = true, py::arg("dtype") = py::none(),
          py::arg("rows") = 0,
          "What the engine will do with a tensor of that many elements (validates the options). "
          "dtype (torch.float16, torch.bfloat16 or their names; default float32) is the "
          "tensor's: codec 'none' on a 16-bit tensor plans the summable ring of its own "
          "format. With codec 'auto' the first call is a collective: the planner calibrates.")
      .def(
          "synchronize",
          [](PyEngine& e) {
            auto engine = e.get();
            py::gil_scoped_release release;
            engine->synchronize();
          },
          "Blocks until every submission so far completed (errors stay with their handles).")
      .def(
          "save_state",
          [](PyEngine& e) {
            auto engine = e.get();
            std::vector<std::byte> state;
            {
              py::gil_scoped_release release;
              state = engine->save_state();
            }
            return py::bytes(reinterpret_cast<const char*>(state.data()), state.size());
          },
          "Error-feedback residuals, codec state and step counters of every tensor, as bytes.")
      .def(
          "load_state",
          [](PyEngine& e, py::buffer state) {
            auto engine = e.get();
            py::buffer_info info = state.request();
            const std::span<const std::byte> bytes(
                static_cast<const std::byte*>(info.ptr),
                static_cast<std::size_t>(info.size) * static_cast<std::size_t>(info.itemsize));
            py::gil_scoped_release release;
            engine->load_state(bytes);
          },
          py::arg("state"),
          "Restores save_state() bytes (no submission may be in flight); the named tensors' next "
          "allreduce continues bit for bit. Raises DecodeError, changing nothing, on bad bytes.")
      .def_property_readonly("rank", [](const PyEngine& e) { return e.get()->rank(); })
      .def_property_readonly("size", [](const PyEngine& e) { return e.get()->size(); })
      .def_property_readonly(
          "bytes_sent", [](const PyEngine& e) { return e.get()->bytes_sent(); },
          "Bytes this rank sent so far (payloads and fp32 chunks, no transport framing).")
      .def_property_readonly(
          "options", [](const PyEngine& e) { return EngineOptions(e.get()->options()); },
          "A copy of the EngineOptions this engine runs with (changing it changes nothing).")
      .def_property_readonly("communicator", &PyEngine::communicator)
      .def_property_readonly("closed", &PyEngine::closed)
      .def("close", &PyEngine::close,
           "Waits for every submission and stops the worker threads; later calls raise.")
      .def("__enter__", [](py::object self) { return self; })
      .def("__exit__", [](PyEngine& e, py::args) { e.close(); });

  // ---- single codecs ------------------------------------------------------------------------
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

  // ---- channel ------------------------------------------------------------------------------
  py::class_<PyChannel>(
      m, "Channel",
      "Point-to-point exchange of float32 tensors between ranks of a Communicator, compressed by "
      "a codec (pipeline stages: activations forward, gradients backward). The k-th send of a "
      "name from rank a to rank b is received by the k-th recv of that name on b from a. Every "
      "wait is bounded by the communicator's timeout; errors name this rank, the peer and the "
      "tensor. Several channels may share a communicator as long as they use different names.")
      .def(py::init<std::shared_ptr<Communicator>, std::uint64_t>(), py::arg("comm"),
           py::arg("seed") = 0)
      .def("send", &PyChannel::send, py::arg("peer"), py::arg("name"), py::arg("tensor"),
           py::arg("codec") = "none",
           "Encodes tensor with codec and starts sending it to peer; the tensor may be reused "
           "at once (the payload is a copy). The Handle completes when the bytes are handed to "
           "the network. NaN or Inf raises InvalidArgument here and fails the receiver too.")
      .def("recv", &PyChannel::recv, py::arg("peer"), py::arg("name"), py::arg("tensor"),
           py::arg("codec") = "none",
           "Starts receiving the next message called name from peer into tensor (its element "
           "count and codec must match the sender's, else MismatchError). The tensor is written "
           "once the message decoded; leave it alone until the Handle completes.")
      .def_property_readonly(
          "bytes_sent", [](const PyChannel& c) { return c.get()->bytes_sent(); },
          "Payload bytes this channel sent so far (codec headers included).")
      .def_property_readonly("communicator", &PyChannel::communicator)
      .def_property_readonly("closed", &PyChannel::closed)
      .def("close", &PyChannel::close,
           "Waits for pending messages (each bounded by the timeout) and stops the channel's "
           "threads; later calls raise.")
      .def("__enter__", [](py::object self) { return self; })
      .def("__exit__", [](PyChannel& c, py::args) { c.close(); });

  // Close channels and engines still open before the interpreter finalizes (see open_engines).
  py::module_::import("atexit").attr("register")(py::cpp_function([] {
    const std::set<PyChannel*> channels = open_channels();
    for (PyChannel* c : channels) c->close();
    const std::set<PyEngine*> engines = open_engines();
    for (PyEngine* e : engines) e->close();
  }));
}

}  // namespace
}  // namespace terse::python

PYBIND11_MODULE(_C, m) {
  // The environment's process-wide settings, before any thread or buffer of terse.
  terse::set_process_options(terse::process_options_from_environment());
  terse::python::bind(m);
}
