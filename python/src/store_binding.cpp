// Stores (the key-value stores ranks bootstrap through) from Python, and torchrun's
// environment as a store.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstddef>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "bindings.h"
#include "convert.h"
#include "python_store.h"
#include "terse/communicator.h"

namespace terse::python {

void bind_stores(py::module_& m) {
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
      .def(
          "add",
          [](Store& s, const std::string& key, std::int64_t delta) {
            py::gil_scoped_release release;
            return s.add(key, delta);
          },
          py::arg("key"), py::arg("delta"),
          "Adds delta to the counter at key (missing: 0) and returns the new value, atomically "
          "across every process using the store.")
      .def_property_readonly(
          "port", [](const Store& s) { return tcp_store_port(s); },
          "The TCP store's port; -1 for other stores.");
  m.def("file_store", &make_file_store, py::arg("directory"),
        "A store in a directory every rank sees (use a fresh directory per job).");
  m.def(
      "tcp_store",
      [](const std::string& host, int port, bool is_server, std::optional<double> timeout,
         std::optional<std::string> secret) {
        const std::string s = resolved_secret(secret);
        py::gil_scoped_release release;
        return make_tcp_store(host, port, is_server, resolved_timeout(timeout), s);
      },
      py::arg("host"), py::arg("port"), py::arg("is_server"), py::arg("timeout") = py::none(),
      py::arg("secret") = py::none(),
      "A TCP store served by one process (is_server; port 0 picks a free one) and used by all. "
      "secret: the job secret every connection must prove (None: TERSE_JOB_SECRET, else none); "
      "a wrong or missing one raises terse.AuthenticationError.");
  m.def("prefix_store", &make_prefix_store, py::arg("prefix"), py::arg("store"),
        "A view of store whose keys all start with prefix + '/'.");
  m.def("python_store", &make_python_store, py::arg("store"),
        "Adapts a torch.distributed.Store (or any object with set(key, bytes), get(key) -> bytes "
        "and wait(keys, timedelta)) to terse.");
  m.def(
      "bootstrap_from_env",
      [](std::optional<double> timeout, std::optional<std::string> secret) {
        const std::string s = resolved_secret(secret);
        Bootstrap b;
        {
          py::gil_scoped_release release;
          b = bootstrap_from_env(resolved_timeout(timeout), s);
        }
        return py::make_tuple(b.rank, b.size, b.store);
      },
      py::arg("timeout") = py::none(), py::arg("secret") = py::none(),
      "(rank, size, store) from torchrun's environment: RANK, WORLD_SIZE and TERSE_FILE_STORE or "
      "MASTER_ADDR/MASTER_PORT (rank 0 then serves a TCP store on MASTER_PORT, guarded by "
      "secret: None means TERSE_JOB_SECRET). The store is made once per process and shared by "
      "every later call and by Communicator.from_env.");
}

}  // namespace terse::python
