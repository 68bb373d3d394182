// Communicator from Python: connecting (a collective) and its few calls.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <memory>
#include <optional>
#include <string>

#include "bindings.h"
#include "convert.h"
#include "gil.h"
#include "terse/communicator.h"
#include "terse/environment.h"

namespace terse::python {

void bind_communicator(py::module_& m) {
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
}

}  // namespace terse::python
