// Channel from Python: point-to-point compressed exchange between ranks (pipeline stages).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <memory>
#include <set>
#include <span>
#include <string>

#include "bindings.h"
#include "convert.h"
#include "gil.h"
#include "handle.h"
#include "terse/channel.h"
#include "terse/communicator.h"
#include "terse/error.h"

namespace terse::python {
namespace {

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

}  // namespace

void bind_channel(py::module_& m) {
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
}

void close_open_channels() {
  const std::set<PyChannel*> channels = open_channels();
  for (PyChannel* c : channels) c->close();
}

}  // namespace terse::python
