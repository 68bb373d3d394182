// Communicator from Python: connecting (a collective) and its few calls.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <fmt/format.h>

#include <cstdint>
#include <memory>
#include <span>
#include <vector>
#include <optional>
#include <string>

#include "bindings.h"
#include "convert.h"
#include "gil.h"
#include "terse/communicator.h"
#include "terse/environment.h"
#include "terse/error.h"

namespace terse::python {

void bind_communicator(py::module_& m) {
  auto make_comm_options = [](std::optional<double> timeout, std::string interface,
                              std::string hostname, std::string prefix,
                              std::optional<std::string> secret) {
    CommunicatorOptions o;
    o.timeout = to_timeout(timeout);
    o.interface = std::move(interface);
    o.hostname = std::move(hostname);
    o.prefix = std::move(prefix);
    o.secret = secret.value_or("");
    return communicator_options_from_environment(std::move(o));
  };
  py::class_<Communicator, std::shared_ptr<Communicator>>(
      m, "Communicator",
      "A fully connected group of processes over Gloo TCP. Every wait is bounded by timeout; "
      "after any failure the communicator is failed for good and peers learn it promptly.")
      .def(py::init([make_comm_options](int rank, int size, std::shared_ptr<Store> store,
                                        std::optional<double> timeout, std::string interface,
                                        std::string hostname, std::string prefix,
                                        std::optional<std::string> secret) {
             auto options = make_comm_options(timeout, std::move(interface), std::move(hostname),
                                              std::move(prefix), std::move(secret));
             std::unique_ptr<Communicator> comm;
             {
               py::gil_scoped_release release;
               comm = Communicator::create(rank, size, std::move(store), std::move(options));
             }
             return share_releasing_gil(std::move(comm));
           }),
           py::arg("rank"), py::arg("size"), py::arg("store"), py::arg("timeout") = py::none(),
           py::arg("interface") = "", py::arg("hostname") = "", py::arg("prefix") = "terse",
           py::arg("secret") = py::none(),
           "Connects to every other rank through store (collective: every rank calls it with the "
           "same size and prefix). timeout: seconds (None: TERSE_TIMEOUT, else 60). interface: "
           "network interface to bind (None: TERSE_IFNAME, GLOO_SOCKET_IFNAME, else hostname). "
           "secret: the job secret every connection must prove (None: TERSE_JOB_SECRET, else "
           "none); a peer that does not raises terse.AuthenticationError naming it.")
      .def_static(
          "from_env",
          [make_comm_options](std::optional<double> timeout, std::string interface,
                              std::string hostname, std::string prefix,
                              std::optional<std::string> secret) {
            auto options = make_comm_options(timeout, std::move(interface), std::move(hostname),
                                             std::move(prefix), std::move(secret));
            std::unique_ptr<Communicator> comm;
            {
              py::gil_scoped_release release;
              comm = Communicator::from_env(std::move(options));
            }
            return share_releasing_gil(std::move(comm));
          },
          py::arg("timeout") = py::none(), py::arg("interface") = "", py::arg("hostname") = "",
          py::arg("prefix") = "terse", py::arg("secret") = py::none(),
          "Bootstraps from torchrun's environment (see bootstrap_from_env); secret guards its "
          "TCP store and every connection (None: TERSE_JOB_SECRET).")
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
          "allgather_bytes",
          [](Communicator& c, py::bytes data, const std::string& label) {
            std::string mine = data;
            std::vector<std::string> out;
            {
              py::gil_scoped_release release;
              const int n = c.size();
              // The sizes first (8 bytes from each rank), then the payloads.
              std::vector<std::uint64_t> sizes(n);
              sizes[c.rank()] = mine.size();
              const std::vector<std::size_t> eight(n, 8);
              c.allgatherv(std::as_bytes(std::span(&sizes[c.rank()], 1)),
                           std::as_writable_bytes(std::span(sizes)), eight, label);
              std::vector<std::size_t> lengths(sizes.begin(), sizes.end());
              std::size_t total = 0;
              for (auto l : lengths) total += l;
              std::string all(total, '\0');
              c.allgatherv(std::as_bytes(std::span(mine.data(), mine.size())),
                           std::as_writable_bytes(std::span(all.data(), all.size())), lengths,
                           label);
              std::size_t at = 0;
              for (auto l : lengths) {
                out.push_back(all.substr(at, l));
                at += l;
              }
            }
            py::list result;
            for (const auto& o : out) result.append(py::bytes(o));
            return result;
          },
          py::arg("data"), py::arg("label") = "",
          "Every rank's bytes, in rank order (a collective; sizes may differ by rank).")
      .def(
          "broadcast_bytes",
          [](Communicator& c, int root, std::optional<py::bytes> data, const std::string& label) {
            if (root < 0 || root >= c.size()) {
              throw InvalidArgument(fmt::format("broadcast_bytes: root {} is not a rank of {}",
                                                root, c.size()));
            }
            if ((c.rank() == root) != data.has_value()) {
              throw InvalidArgument("broadcast_bytes: the root passes data, the others None");
            }
            std::string buf = data ? std::string(*data) : std::string();
            {
              py::gil_scoped_release release;
              std::uint64_t size = buf.size();
              c.broadcast(root, std::as_writable_bytes(std::span(&size, 1)), label);
              buf.resize(size);
              c.broadcast(root, std::as_writable_bytes(std::span(buf.data(), buf.size())), label);
            }
            return py::bytes(buf);
          },
          py::arg("root"), py::arg("data") = py::none(), py::arg("label") = "",
          "root's bytes on every rank (a collective; the others pass None).")
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
