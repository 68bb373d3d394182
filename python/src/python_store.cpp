#include "python_store.h"

#include <fmt/format.h>

#include <string>
#include <vector>

#include "gil.h"
#include "terse/error.h"

namespace terse::python {
namespace {

class PythonStore final : public Store {
 public:
  explicit PythonStore(py::object store) : store_(std::move(store)) {
    for (const char* method : {"set", "get", "wait"}) {
      if (!py::hasattr(store_.get(), method)) {
        throw InvalidArgument(fmt::format(
            "store: {} has no {}() method; pass a torch.distributed.Store or an object with "
            "set(key, value), get(key) and wait(keys, timedelta)",
            describe(), method));
      }
    }
  }

  void set(const std::string& key, std::span<const std::byte> value) override {
    py::gil_scoped_acquire gil;
    try {
      store_.get().attr("set")(
          key, py::bytes(reinterpret_cast<const char*>(value.data()), value.size()));
    } catch (py::error_already_set& e) {
      throw TransportError(fmt::format("store {}: set '{}' failed: {}", describe(), key, e.what()));
    }
  }

  std::vector<std::byte> get(const std::string& key, std::chrono::milliseconds timeout) override {
    // torch's get() waits for the store's own timeout, not ours: wait with ours first.
    wait(std::span<const std::string>(&key, 1), timeout);
    py::gil_scoped_acquire gil;
    try {
      py::object value = store_.get().attr("get")(key);
      char* data = nullptr;
      Py_ssize_t size = 0;
      if (!PyBytes_Check(value.ptr()) || PyBytes_AsStringAndSize(value.ptr(), &data, &size) != 0) {
        PyErr_Clear();
        throw TransportError(fmt::format("store {}: get '{}' returned {}, not bytes", describe(),
                                         key,
                                         py::type::of(value).attr("__name__").cast<std::string>()));
      }
      const auto* bytes = reinterpret_cast<const std::byte*>(data);
      return std::vector<std::byte>(bytes, bytes + size);
    } catch (py::error_already_set& e) {
      throw TransportError(fmt::format("store {}: get '{}' failed: {}", describe(), key, e.what()));
    }
  }

  std::int64_t add(const std::string& key, std::int64_t delta) override {
    py::gil_scoped_acquire gil;
    try {
      return store_.get().attr("add")(key, delta).cast<std::int64_t>();
    } catch (py::error_already_set& e) {
      throw TransportError(fmt::format("store {}: add '{}' failed: {}", describe(), key, e.what()));
    }
  }

  void wait(std::span<const std::string> keys, std::chrono::milliseconds timeout) override {
    py::gil_scoped_acquire gil;
    py::list names;
    for (const auto& k : keys) names.append(k);
    py::object delta = py::module_::import("datetime")
                           .attr("timedelta")(py::arg("milliseconds") = timeout.count());
    try {
      store_.get().attr("wait")(names, delta);
    } catch (py::error_already_set& e) {
      // torch reports a timeout and a lost server alike as RuntimeError; the first is by far the
      // common case (a rank that never arrived), and the text says which it was.
      throw TimeoutError(fmt::format(
          "store {}: waited {} ms for key '{}'{}: {}", describe(), timeout.count(),
          keys.empty() ? "" : keys[0],
          keys.size() > 1 ? fmt::format(" and {} more", keys.size() - 1) : "", e.what()));
    }
  }

 private:
  // GIL required.
  std::string describe() const {
    return py::type::of(store_.get()).attr("__name__").cast<std::string>();
  }

  PythonRef store_;
};

}  // namespace

std::shared_ptr<Store> make_python_store(py::object store) {
  return std::make_shared<PythonStore>(std::move(store));
}

}  // namespace terse::python
