// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

#include <cstdint>
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <system_error>

namespace seqpar {

/// Why a distributed operation failed. Values are the error codes of `error_category()`.
enum class Errc : int {
  kPeerFailed = 1,  ///< another rank threw; this rank was released from a wait
  kTimeout = 2,     ///< a wait exceeded the configured bound
  kTransport = 3,   ///< the transport itself failed (MPI, NCCL, ...)
  kMismatch = 4,    ///< ranks disagree on batch, shape or strategy
  kProtocol = 5,    ///< a message of the wrong size or tag arrived
  kStepFailed = 6,  ///< a step of a program (a kernel call, a copy) threw on this rank
};

namespace detail {
class SeqparCategory final : public std::error_category {
 public:
  [[nodiscard]] const char* name() const noexcept override { return "seqpar"; }
  [[nodiscard]] std::string message(int code) const override {
    switch (static_cast<Errc>(code)) {
      case Errc::kPeerFailed:
        return "peer rank failed";
      case Errc::kTimeout:
        return "timed out waiting for a peer";
      case Errc::kTransport:
        return "transport failure";
      case Errc::kMismatch:
        return "ranks disagree";
      case Errc::kProtocol:
        return "protocol violation";
      case Errc::kStepFailed:
        return "program step failed";
    }
    return "unknown seqpar error";
  }
};
}  // namespace detail

[[nodiscard]] inline const std::error_category& error_category() noexcept {
  static const detail::SeqparCategory category;
  return category;
}

/// Transport and coordination failures. Bad arguments are `std::invalid_argument` instead.
/// what() is "<detail>: <category message>"; detail() is the part without the category message, for
/// adding context when an error is passed on.
class Error : public std::system_error {
 public:
  Error(Errc code, const std::string& what)
      : std::system_error(static_cast<int>(code), error_category(), what), detail_(what) {}
  Error(std::error_code code, const std::string& what) : std::system_error(code, what), detail_(what) {}
  [[nodiscard]] Errc errc() const noexcept { return static_cast<Errc>(code().value()); }
  [[nodiscard]] const std::string& detail() const noexcept { return detail_; }

 private:
  std::string detail_;
};

namespace detail {

/// "<where>: <argument> = <value>: <why>", the message of every bad-argument error and refusal.
template <class Value>
[[nodiscard]] std::string invalid_message(std::string_view where, std::string_view argument, const Value& value,
                                          std::string_view why) {
  std::ostringstream os;
  os << where << ": " << argument << " = " << value << ": " << why;
  return os.str();
}

/// Throws std::invalid_argument("<where>: <argument> = <value>: <why>").
template <class Value>
[[noreturn]] void throw_invalid(std::string_view where, std::string_view argument, const Value& value,
                                std::string_view why) {
  throw std::invalid_argument(invalid_message(where, argument, value, why));
}

template <class Value>
void require(bool ok, std::string_view where, std::string_view argument, const Value& value, std::string_view why) {
  if (!ok) throw_invalid(where, argument, value, why);
}

}  // namespace detail
}  // namespace seqpar
