// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
// The file store of the NCCL bootstrap: plain C++ (no CUDA, no NCCL), so that it is tested on any machine.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <random>
#include <span>
#include <string>
#include <system_error>
#include <thread>
#include <utility>

#include "seqpar/core/error.hpp"
#include "seqpar/core/timeout.hpp"

namespace seqpar::backend::nccl {

/// Shares a few bytes (the communicator's ncclUniqueId) from rank 0 to the other ranks through a file
/// on a path every rank sees: a local folder for the processes of one node, a shared file system
/// across nodes. For jobs launched without MPI (`Transport::bootstrap(store, rank, size)`).
///
///  - publish (rank 0) writes a temporary file beside `path` and renames it onto `path`, so a reader
///    sees the whole value or nothing; a file already there is replaced.
///  - fetch (the other ranks) polls for `path` (1 ms apart at most) until it appears or `timeout`
///    passes (Errc::kTimeout naming the path); a file of another size than the value is
///    Errc::kProtocol (not this job's).
///  - The path must be fresh for each job: a file left by an earlier job would be read as this job's
///    value (its communicator then times out). `Transport::bootstrap` removes the file once every rank
///    has joined, so only a job that died while starting leaves one; put the job id in the name.
///
/// @code
/// nccl::FileStore store("/dev/shm/seqpar_" + job_id, std::chrono::seconds(60));
/// nccl::Transport t = nccl::Transport::bootstrap(store, rank, size);
/// @endcode
class FileStore {
 public:
  explicit FileStore(std::filesystem::path path, std::chrono::milliseconds timeout = std::chrono::seconds{120})
      : path_(std::move(path)), timeout_(seqpar::detail::checked_timeout("nccl::FileStore", "timeout", timeout)) {
    seqpar::detail::require(!path_.empty(), "nccl::FileStore", "path", "\"\"", "must name a file");
  }

  [[nodiscard]] const std::filesystem::path& path() const noexcept { return path_; }
  [[nodiscard]] std::chrono::milliseconds timeout() const noexcept { return timeout_; }

  /// Writes `value` to path() atomically (rank 0).
  void publish(std::span<const std::byte> value) const {
    std::random_device entropy;
    const auto nonce = (static_cast<std::uint64_t>(entropy()) << 32) ^ static_cast<std::uint64_t>(entropy()) ^
                       static_cast<std::uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
    std::filesystem::path tmp = path_;
    tmp += ".tmp." + std::to_string(nonce);
    {
      std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
      if (out) out.write(reinterpret_cast<const char*>(value.data()), static_cast<std::streamsize>(value.size()));
      if (!out || !out.flush())
        throw Error(Errc::kTransport,
                    "nccl::FileStore: cannot write '" + tmp.string() + "' (does the folder exist and is it writable?)");
    }
    std::error_code ec;
    std::filesystem::rename(tmp, path_, ec);
    if (ec) {
      std::filesystem::remove(tmp, ec);
      throw Error(Errc::kTransport,
                  "nccl::FileStore: cannot rename '" + tmp.string() + "' to '" + path_.string() + "': " + ec.message());
    }
  }

  /// Waits for path() and reads exactly value.size() bytes from it (the other ranks).
  void fetch(std::span<std::byte> value) const {
    const auto deadline = std::chrono::steady_clock::now() + timeout_;
    auto nap = std::chrono::microseconds(50);
    for (;;) {
      std::error_code ec;
      const std::uintmax_t size = std::filesystem::file_size(path_, ec);
      if (!ec) {
        if (size != value.size())
          throw Error(Errc::kProtocol, "nccl::FileStore: '" + path_.string() + "' holds " + std::to_string(size) +
                                           " bytes, expected " + std::to_string(value.size()) +
                                           " (a file of another job? use a fresh path)");
        std::ifstream in(path_, std::ios::binary);
        if (in.read(reinterpret_cast<char*>(value.data()), static_cast<std::streamsize>(value.size()))) return;
        // Replaced or removed between the size and the read: look again.
      }
      if (std::chrono::steady_clock::now() >= deadline)
        throw Error(Errc::kTimeout, "nccl::FileStore: '" + path_.string() + "' did not appear within " +
                                        std::to_string(timeout_.count()) +
                                        " ms (rank 0 publishes it: is rank 0 running, on the same path?)");
      std::this_thread::sleep_for(nap);
      nap = std::min(nap * 2, std::chrono::microseconds(1000));
    }
  }

  /// Removes path() if it is there (rank 0, once every rank has read it).
  void remove() const noexcept {
    std::error_code ec;
    std::filesystem::remove(path_, ec);
  }

 private:
  std::filesystem::path path_;
  std::chrono::milliseconds timeout_;
};

}  // namespace seqpar::backend::nccl
