// Stores that need no server: Gloo's FileStore behind terse::Store, and a key-prefixing view.
#include <fmt/format.h>
#include <gloo/common/error.h>
#include <gloo/rendezvous/file_store.h>

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <cctype>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <functional>
#include <mutex>

#include "terse/communicator.h"
#include "terse/error.h"

namespace terse {

std::int64_t Store::add(const std::string& key, std::int64_t) {
  throw InvalidArgument(fmt::format("this store has no atomic add (key '{}'): use terse's TCP "
                                    "store, a file store or a torch.distributed store",
                                    key));
}

namespace {

class FileStore final : public Store {
 public:
  explicit FileStore(const std::string& directory) : directory_(directory), store_(make(directory)) {}

  void set(const std::string& key, std::span<const std::byte> value) override {
    std::vector<char> bytes(value.size());
    if (!value.empty()) std::memcpy(bytes.data(), value.data(), value.size());
    std::lock_guard lock(mutex_);
    try {
      store_.set(key, bytes);
    } catch (const std::exception& e) {
      throw TransportError(fmt::format("file store {}: set '{}' failed: {}", directory_, key,
                                       e.what()));
    }
  }

  std::vector<std::byte> get(const std::string& key, std::chrono::milliseconds timeout) override {
    const std::string keys[] = {key};
    wait(keys, timeout);
    std::vector<char> bytes;
    {
      std::lock_guard lock(mutex_);
      try {
        bytes = store_.get(key);
      } catch (const std::exception& e) {
        throw TransportError(fmt::format("file store {}: get '{}' failed: {}", directory_, key,
                                         e.what()));
      }
    }
    std::vector<std::byte> out(bytes.size());
    if (!bytes.empty()) std::memcpy(out.data(), bytes.data(), bytes.size());
    return out;
  }

  // A counter file per key under counters/, read and rewritten under flock (processes) and the
  // mutex (threads of this process).
  std::int64_t add(const std::string& key, std::int64_t delta) override {
    std::string name;
    for (char c : key) name += std::isalnum(static_cast<unsigned char>(c)) ? c : '_';
    const std::string path = fmt::format("{}/counters/{}-{:016x}", directory_, name,
                                         std::hash<std::string>{}(key));
    std::lock_guard lock(mutex_);
    std::error_code ec;
    std::filesystem::create_directories(directory_ + "/counters", ec);
    const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (fd < 0) {
      throw TransportError(fmt::format("file store {}: add '{}': cannot open {}: {}", directory_,
                                       key, path, std::strerror(errno)));
    }
    std::int64_t value = 0;
    bool ok = ::flock(fd, LOCK_EX) == 0;
    if (ok) {
      const ssize_t n = ::pread(fd, &value, sizeof(value), 0);
      if (n != static_cast<ssize_t>(sizeof(value))) value = 0;
      value += delta;
      ok = ::pwrite(fd, &value, sizeof(value), 0) == static_cast<ssize_t>(sizeof(value));
    }
    const int err = errno;
    ::close(fd);  // releases the lock
    if (!ok) {
      throw TransportError(fmt::format("file store {}: add '{}' failed: {}", directory_, key,
                                       std::strerror(err)));
    }
    return value;
  }

  void wait(std::span<const std::string> keys, std::chrono::milliseconds timeout) override {
    std::vector<std::string> list(keys.begin(), keys.end());
    try {
      // Gloo's FileStore::wait polls the file system; it keeps no state, so no lock.
      store_.wait(list, timeout);
    } catch (const gloo::IoException& e) {
      throw TimeoutError(fmt::format("file store {}: waited {} ms for key '{}' ({})",
                                     directory_, timeout.count(), list.empty() ? "" : list[0],
                                     e.what()));
    }
  }

 private:
  static gloo::rendezvous::FileStore make(const std::string& directory) {
    std::error_code ec;
    std::filesystem::create_directories(directory, ec);
    if (ec) {
      throw InvalidArgument(
          fmt::format("file store: cannot create directory {}: {}", directory, ec.message()));
    }
    return gloo::rendezvous::FileStore(directory);
  }

  std::string directory_;
  std::mutex mutex_;  // FileStore::set records paths in a vector.
  gloo::rendezvous::FileStore store_;
};

class PrefixStore final : public Store {
 public:
  PrefixStore(std::string prefix, std::shared_ptr<Store> store)
      : prefix_(std::move(prefix) + "/"), store_(std::move(store)) {
    if (!store_) throw InvalidArgument("prefix store: no store given");
  }

  void set(const std::string& key, std::span<const std::byte> value) override {
    store_->set(prefix_ + key, value);
  }
  std::vector<std::byte> get(const std::string& key, std::chrono::milliseconds timeout) override {
    return store_->get(prefix_ + key, timeout);
  }
  std::int64_t add(const std::string& key, std::int64_t delta) override {
    return store_->add(prefix_ + key, delta);
  }
  void wait(std::span<const std::string> keys, std::chrono::milliseconds timeout) override {
    std::vector<std::string> full;
    full.reserve(keys.size());
    for (const auto& k : keys) full.push_back(prefix_ + k);
    store_->wait(full, timeout);
  }

 private:
  std::string prefix_;
  std::shared_ptr<Store> store_;
};

}  // namespace

std::shared_ptr<Store> make_file_store(const std::string& directory) {
  return std::make_shared<FileStore>(directory);
}

std::shared_ptr<Store> make_prefix_store(std::string prefix, std::shared_ptr<Store> store) {
  return std::make_shared<PrefixStore>(std::move(prefix), std::move(store));
}

}  // namespace terse
