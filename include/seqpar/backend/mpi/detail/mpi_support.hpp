// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
// Internals of the MPI backend: the error category, byte-count datatypes, deadline polling.
#pragma once

#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstddef>
#include <cstdint>
#include <string>
#include <system_error>
#include <thread>
#include <utility>

namespace seqpar::backend::mpi {

namespace detail {

/// The text MPI gives for an error code (MPI_Error_string), or "MPI error <code>".
[[nodiscard]] inline std::string error_string(int code) {
  char text[MPI_MAX_ERROR_STRING] = {};
  int length = 0;
  if (MPI_Error_string(code, text, &length) != MPI_SUCCESS || length <= 0) return "MPI error " + std::to_string(code);
  return std::string(text, static_cast<std::size_t>(length));
}

class MpiCategory final : public std::error_category {
 public:
  [[nodiscard]] const char* name() const noexcept override { return "mpi"; }
  [[nodiscard]] std::string message(int code) const override { return error_string(code); }
};

}  // namespace detail

/// The error category of MPI return codes: `Error::code().message()` is MPI_Error_string.
[[nodiscard]] inline const std::error_category& mpi_category() noexcept {
  static const detail::MpiCategory category;
  return category;
}

namespace detail {

/// The MPI error class of a return code (MPI_ERR_TRUNCATE, ...); the code itself if MPI cannot say.
[[nodiscard]] inline int error_class(int code) noexcept {
  int cls = code;
  if (MPI_Error_class(code, &cls) != MPI_SUCCESS) return code;
  return cls;
}

/// A committed MPI datatype of `unit` contiguous bytes (MPI_BYTE when unit is 1), built so that no
/// int count inside it exceeds `max_count`: up to max_count bytes a contiguous type, above it a struct
/// of q blocks of max_count bytes plus the remainder. Its type signature is `unit` MPI_BYTEs, so a
/// message sent in one unit matches a receive posted in another whenever the byte totals agree:
/// every rank picks its units locally. Frees its type on destruction (MPI keeps a type alive for the
/// pending operations that use it).
class UnitType {
 public:
  UnitType() noexcept = default;
  UnitType(std::size_t unit, std::size_t max_count) {
    if (unit <= 1) return;
    if (unit <= max_count) {
      rc_ = MPI_Type_contiguous(static_cast<int>(unit), MPI_BYTE, &type_);
    } else {
      const std::size_t blocks = unit / max_count, rest = unit % max_count;
      if (blocks > static_cast<std::size_t>(INT_MAX)) {
        rc_ = MPI_ERR_COUNT;
        return;
      }
      MPI_Datatype chunk = MPI_DATATYPE_NULL;
      if ((rc_ = MPI_Type_contiguous(static_cast<int>(max_count), MPI_BYTE, &chunk)) != MPI_SUCCESS) return;
      int lengths[2] = {static_cast<int>(blocks), static_cast<int>(rest)};
      MPI_Aint displs[2] = {0, static_cast<MPI_Aint>(blocks * max_count)};
      MPI_Datatype types[2] = {chunk, MPI_BYTE};
      rc_ = MPI_Type_create_struct(rest == 0 ? 1 : 2, lengths, displs, types, &type_);
      MPI_Type_free(&chunk);
    }
    if (rc_ == MPI_SUCCESS) rc_ = MPI_Type_commit(&type_);
    if (rc_ == MPI_SUCCESS)
      owned_ = true;
    else
      type_ = MPI_BYTE;
  }
  UnitType(UnitType&& other) noexcept
      : type_(std::exchange(other.type_, MPI_BYTE)), rc_(other.rc_), owned_(std::exchange(other.owned_, false)) {}
  UnitType& operator=(UnitType&& other) noexcept {
    if (this != &other) {
      reset();
      type_ = std::exchange(other.type_, MPI_BYTE);
      rc_ = other.rc_;
      owned_ = std::exchange(other.owned_, false);
    }
    return *this;
  }
  UnitType(const UnitType&) = delete;
  UnitType& operator=(const UnitType&) = delete;
  ~UnitType() { reset(); }

  [[nodiscard]] MPI_Datatype type() const noexcept { return type_; }
  /// MPI_SUCCESS, or the return code of the call that failed to build the type.
  [[nodiscard]] int status() const noexcept { return rc_; }
  void reset() noexcept {
    int finalized = 0;
    if (owned_ && MPI_Finalized(&finalized) == MPI_SUCCESS && !finalized) MPI_Type_free(&type_);
    owned_ = false;
    type_ = MPI_BYTE;
  }

 private:
  MPI_Datatype type_ = MPI_BYTE;
  int rc_ = MPI_SUCCESS;
  bool owned_ = false;
};

/// Calls `test()` (which returns true when the operation completed) until it does or `deadline`
/// passes; returns false on timeout. Spins briefly (lowest latency), then yields, then sleeps with
/// exponential backoff up to 1 ms, so an oversubscribed node is not starved by ranks that wait.
template <class Test>
[[nodiscard]] bool poll_until(std::chrono::steady_clock::time_point deadline, Test&& test) {
  using clock = std::chrono::steady_clock;
  const auto start = clock::now();
  auto nap = std::chrono::microseconds(5);
  for (std::uint64_t i = 0;; ++i) {
    if (test()) return true;
    const auto now = clock::now();
    if (now >= deadline) return test();
    const auto waited = now - start;
    if (waited < std::chrono::microseconds(50)) continue;
    if (waited < std::chrono::milliseconds(2)) {
      std::this_thread::yield();
      continue;
    }
    std::this_thread::sleep_for(nap);
    nap = std::min(nap * 2, std::chrono::microseconds(1000));
  }
}

}  // namespace detail
}  // namespace seqpar::backend::mpi
