// The options and plans from Python: AllreduceOptions, TensorPlan and EngineOptions (whose
// auto_codecs and heavy_codecs make the engine's planner).
#include <fmt/format.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "bindings.h"
#include "terse/engine.h"
#include "terse/environment.h"
#include "terse/plan.h"
#include "terse/planner.h"

namespace terse::python {
namespace {

std::string options_repr(const AllreduceOptions& o) {
  return fmt::format("AllreduceOptions(codec='{}', strategy='{}', partitions={}, average={}{}{})",
                     o.codec, to_string(o.strategy), o.partitions, o.average ? "True" : "False",
                     o.rows > 0 ? fmt::format(", rows={}", o.rows) : std::string(),
                     o.hierarchy != Hierarchy::kAuto
                         ? fmt::format(", hierarchy='{}'", to_string(o.hierarchy))
                         : std::string());
}

}  // namespace

void bind_options(py::module_& m) {
  py::class_<AllreduceOptions>(m, "AllreduceOptions",
                               "How one tensor is reduced: codec spec (or 'auto', 'auto:heavy': "
                               "the planner's choice), strategy, partitions (0: from the size), "
                               "average (divide by ranks) and rows (the tensor's first "
                               "dimension, 0: not given: a matrix codec that 'auto' chooses "
                               "views the tensor as rows x n/rows) and hierarchy ('auto', "
                               "'flat', 'hosts': exact inside each host, the codec across "
                               "hosts; docs/topology.md).")
      .def(py::init(&make_options), py::arg("codec") = "none", py::arg("strategy") = "auto",
           py::arg("partitions") = 0, py::arg("average") = true, py::arg("rows") = 0,
           py::arg("hierarchy") = "auto")
      .def_property(
          "hierarchy",
          [](const AllreduceOptions& o) { return std::string(to_string(o.hierarchy)); },
          [](AllreduceOptions& o, const std::string& h) { o.hierarchy = parse_hierarchy(h); })
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
      .def_readonly("hierarchical", &TensorPlan::hierarchical,
                    "Two levels over the hosts: the codec and strategy run across them.")
      .def("__repr__", [](const TensorPlan& p) {
        return fmt::format("TensorPlan(codec='{}', strategy='{}', partitions={})", p.codec,
                           to_string(p.strategy), p.partitions);
      });

  py::class_<EngineOptions>(m, "EngineOptions",
                            "Engine-wide settings (see include/terse/engine.h).")
      .def(py::init([](std::uint64_t seed, int threads, std::size_t fuse_bytes,
                       std::size_t partition_bytes, std::size_t gather_bytes,
                       bool keep_input_on_error, std::vector<std::string> auto_codecs,
                       std::vector<std::string> heavy_codecs, std::string topology,
                       std::string host) {
             EngineOptions o;
             o.topology = std::move(topology);
             o.host = std::move(host);
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
           py::arg("topology") = "auto", py::arg("host") = "",
           "auto_codecs: the light tier, the codecs codec='auto' may choose from; heavy_codecs: "
           "the heavy tier, which codec='auto:heavy' may choose from as well. Empty: the "
           "planner's defaults, TERSE_PLAN_CODECS and TERSE_PLAN_HEAVY_CODECS, else the tiers "
           "docs/planner.md lists (PlannerOptions in the C++ API). ['none']: raw only, or no "
           "heavy codec. topology: which ranks share a host ('auto': machine, network "
           "namespace and host; 'A,B,...' ranks per host; 'HxR'; 'flat'), else TERSE_TOPOLOGY; "
           "host: this rank's host name for 'auto', else TERSE_HOST or torchrun's GROUP_RANK.")
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
      .def_readwrite("topology", &EngineOptions::topology,
                     "Which ranks share a host: 'auto', 'flat', 'A,B,...' or 'HxR' "
                     "(docs/topology.md).")
      .def_readwrite("host", &EngineOptions::host, "This rank's host name under topology 'auto'.")
      .def_readwrite("intra_host", &EngineOptions::intra_host,
                     "How a host's ranks move bytes inside two-level collectives: 'auto' (read "
                     "each other's memory directly where every rank of the host can) or 'tcp' "
                     "(messages); else TERSE_INTRA_HOST.")
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
}

}  // namespace terse::python
