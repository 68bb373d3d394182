// Engine and Handle from Python: submissions borrow their tensors until they complete, and
// every call that can block or talk to other ranks releases the GIL.
#include <fmt/format.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstddef>
#include <memory>
#include <set>
#include <span>
#include <string>
#include <vector>

#include "bindings.h"
#include "convert.h"
#include "gil.h"
#include "handle.h"
#include "terse/communicator.h"
#include "terse/engine.h"
#include "terse/environment.h"
#include "terse/error.h"
#include "terse/plan.h"

namespace terse::python {

AllreduceOptions make_options(std::string codec, const std::string& strategy, int partitions,
                              bool average, std::size_t rows, const std::string& hierarchy) {
  AllreduceOptions o;
  o.hierarchy = parse_hierarchy(hierarchy);
  o.codec = std::move(codec);
  o.strategy = parse_strategy(strategy);
  o.partitions = partitions;
  o.average = average;
  o.rows = rows;
  return o;
}

namespace {

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
                     const std::string& strategy, int partitions, bool average,
                     const std::string& hierarchy) {
    auto engine = get();
    AllreduceOptions options =
        make_options(std::move(codec), strategy, partitions, average, 0, hierarchy);
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
                      bool average, const std::string& hierarchy = "auto") {
    auto engine = get();
    CollectiveOptions options;
    options.hierarchy = parse_hierarchy(hierarchy);
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
      ref.tensor = tensor_view(t[1], ref.name);
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

using EngineClass = py::class_<PyEngine>;

// allreduce, reduce_scatter, all_gather, all_to_all, allreduce_group.
void define_submissions(EngineClass& cls) {
  cls
      .def("allreduce", &PyEngine::allreduce, py::arg("name"), py::arg("tensor"),
           py::arg("codec") = "none", py::arg("strategy") = "auto", py::arg("partitions") = 0,
           py::arg("average") = true, py::arg("hierarchy") = "auto",
           "Starts an allreduce of one tensor (a contiguous CPU torch.Tensor of float32, float16 "
           "or bfloat16, or a float32 or float16 buffer; 16-bit tensors are reduced in fp32 a "
           "partition at a time and rounded once); "
           "returns a Handle. Raises at once for invalid options.")
      .def(
          "reduce_scatter",
          [](PyEngine& e, std::string name, py::object input, py::object output,
             std::string codec, const std::string& strategy, int partitions, bool average,
             const std::string& hierarchy) {
            return e.collective("reduce_scatter", std::move(name), std::move(input),
                                std::move(output), {}, {}, std::move(codec), strategy,
                                partitions, average, hierarchy);
          },
          py::arg("name"), py::arg("input"), py::arg("output"), py::arg("codec") = "none",
          py::arg("strategy") = "auto", py::arg("partitions") = 0, py::arg("average") = true,
          py::arg("hierarchy") = "auto",
          "Starts a reduce-scatter; returns a Handle. input holds world size x n float32 "
          "elements (rank r's shard at [r*n, (r+1)*n)); output (n elements) receives the sum over "
          "ranks of this rank's shard, divided by the world size when average. Strategies: "
          "'raw' (codec 'none': the fp32 rank-order sum), 'alltoall' (the default for a codec: "
          "each contribution quantized once, as ZeRO++'s qgZ), 'sharded', 'ring', 'summable' "
          "(the allreduce's halves: its result for the shard). Error feedback is kept per "
          "shard. codec 'auto': the planner's choice of raw or an allowed codec (EngineOptions' "
          "auto_codecs), strategy and partitions for this size. hierarchy: 'auto', 'flat' or "
          "'hosts' (two levels over the job's hosts: an exact sum inside each host, then the "
          "codec across hosts; docs/topology.md). Raises at once for sizes or options it "
          "cannot honour.")
      .def(
          "all_gather",
          [](PyEngine& e, std::string name, py::object input, py::object output,
             std::string codec, const std::string& strategy, int partitions,
             const std::string& hierarchy) {
            return e.collective("all_gather", std::move(name), std::move(input),
                                std::move(output), {}, {}, std::move(codec), strategy,
                                partitions, false, hierarchy);
          },
          py::arg("name"), py::arg("input"), py::arg("output"), py::arg("codec") = "none",
          py::arg("strategy") = "auto", py::arg("partitions") = 0, py::arg("hierarchy") = "auto",
          "Starts an all-gather; returns a Handle. input holds this rank's shard of n elements "
          "(float32, float16 or bfloat16; it may be a view of output's own shard); output "
          "(world size x n elements, same dtype) receives rank r's shard at [r*n, (r+1)*n). "
          "With a lossy codec each shard is encoded once by its owner and every rank decodes "
          "the same bytes: every rank's output is bit-identical. codec 'auto': the planner's "
          "choice of raw or an allowed codec (EngineOptions' auto_codecs) for this size. "
          "hierarchy: 'auto', 'flat' or 'hosts' (each shard crosses once to every other host, "
          "then its payload is handed on inside each host; docs/topology.md).")
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
           "bucket: small raw tensors travel fused, the others per their codec.");
}

// plan, calibrate, synchronize, save_state, load_state, the properties and close.
void define_state(EngineClass& cls) {
  cls
      .def(
          "plan",
          [](PyEngine& e, std::size_t elements, std::string codec, const std::string& strategy,
             int partitions, bool average, py::object dtype, std::size_t rows,
             const std::string& hierarchy) {
            auto engine = e.get();
            const AllreduceOptions options =
                make_options(std::move(codec), strategy, partitions, average, rows, hierarchy);
            const DType type = dtype.is_none() ? DType::kFloat32 : parse_dtype(dtype);
            py::gil_scoped_release release;  // codec "auto": the first call calibrates
            return engine->plan(elements, options, type);
          },
          py::arg("elements"), py::arg("codec") = "none", py::arg("strategy") = "auto",
          py::arg("partitions") = 0, py::arg("average") = true, py::arg("dtype") = py::none(),
          py::arg("rows") = 0, py::arg("hierarchy") = "auto",
          "What the engine will do with a tensor of that many elements (validates the options). "
          "dtype (torch.float16, torch.bfloat16 or their names; default float32) is the "
          "tensor's: codec 'none' on a 16-bit tensor plans the summable ring of its own "
          "format. With codec 'auto' the first call is a collective: the planner calibrates.")
      .def(
          "calibrate",
          [](PyEngine& e) {
            auto engine = e.get();
            py::gil_scoped_release release;
            engine->calibrate();
          },
          "Calibrates codec 'auto''s planner now (a collective: every rank calls it at the same "
          "point; a few seconds, or the ranks agree on the cached calibration). Later calls "
          "exchange nothing. Front ends call it at start-up, so that calibration does not run "
          "inside the first backward pass.")
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
          "bytes_sent_across_hosts",
          [](const PyEngine& e) { return e.get()->bytes_sent_across_hosts(); },
          "The part of bytes_sent that went to ranks on other hosts (see hosts).")
      .def_property_readonly(
          "hosts", [](const PyEngine& e) { return e.get()->hosts(); },
          "The job's hosts as every rank agreed on them (EngineOptions' topology, "
          "TERSE_TOPOLOGY): each host's ranks, hosts ordered by their lowest rank.")
      .def_property_readonly(
          "reads_directly_inside_host",
          [](const PyEngine& e) { return e.get()->reads_directly_inside_host(); },
          "Whether this rank's host's ranks read each other's memory directly in the phases of "
          "two-level collectives inside the host (EngineOptions' intra_host, TERSE_INTRA_HOST).")
      .def_property_readonly(
          "options", [](const PyEngine& e) { return EngineOptions(e.get()->options()); },
          "A copy of the EngineOptions this engine runs with (changing it changes nothing).")
      .def_property_readonly("communicator", &PyEngine::communicator)
      .def_property_readonly("closed", &PyEngine::closed)
      .def("close", &PyEngine::close,
           "Waits for every submission and stops the worker threads; later calls raise.")
      .def("__enter__", [](py::object self) { return self; })
      .def("__exit__", [](PyEngine& e, py::args) { e.close(); });
}

}  // namespace

void bind_engine(py::module_& m) {
  py::class_<PyHandle>(m, "Handle", "The outcome of a submission.")
      .def("wait", &PyHandle::wait,
           "Blocks (without the GIL) until the submission completed; raises its error. Bounded "
           "by the communicator's timeout.")
      .def("ready", &PyHandle::ready)
      .def("on_complete", &PyHandle::on_complete, py::arg("callback"),
           "Calls callback(error) once the submission completed (error is None on success): at "
           "once if it already has, else on an engine thread holding the GIL. The callback must "
           "not wait for the engine.");

  EngineClass engine(m, "Engine",
                     "Asynchronous compression-aware allreduce (and reduce-scatter, all-gather, "
                     "all-to-all) of named float32, float16 and bfloat16 tensors. Every "
                     "rank must submit the same tensors with the same options in the same "
                     "order; results are written in place and are bit-identical on all ranks.");
  engine.def(py::init<std::shared_ptr<Communicator>, const EngineOptions&>(), py::arg("comm"),
             py::arg("options") = EngineOptions{});
  define_submissions(engine);
  define_state(engine);
}

void close_open_engines() {
  const std::set<PyEngine*> engines = open_engines();
  for (PyEngine* e : engines) e->close();
}

}  // namespace terse::python
