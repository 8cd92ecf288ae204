// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

#include <array>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "seqpar/core/error.hpp"
#include "seqpar/core/hash.hpp"

namespace seqpar::runtime {

/// The one cross-rank agreement of a collective call (DistributedAttention's calls, ChunkedAttention's
/// begin and per-chunk calls, train::run_pipelined_step): before any data moves, every rank tells every
/// other, in one all_gather of a fixed-size record, what it is about to run (the batch's and chunk plan's
/// fingerprints, the mask, the shape, the element type, the layer (runtime/layer_order.hpp), the strategy
/// and its arguments, the call and pass, the replicated inputs' fingerprints) and whether its own local
/// checks passed. A binding whose own checks refuse before the engine's call runs a record of its own with
/// the refusal (the torch op: python/src/ops.cpp), which the peers' agreement receives as this one's. Then, on every
/// rank alike:
///  1. a rank that refused its arguments rethrows its own exception (std::invalid_argument naming the
///     argument), and its peers throw Errc::kPeerFailed with its reason (a refusing rank's words may not
///     be comparable: its call never got as far as knowing them);
///  2. otherwise a word that differs between two ranks is Errc::kMismatch naming the word and both values;
/// so a bad call fails on every rank at once, never as a hang, a crash or another rank's wrong rows.
///
/// Words are added in the same order on every rank (the same code runs there); a word added with
/// `own` is exchanged but not compared (a stage's widths, compared by the caller across stages through
/// `record(r)`). At most kMaxWords words: a list longer than that is folded into one word with Hash64.
/// Allocates nothing (fixed arrays; messages are built only to throw): steady-state calls stay
/// allocation-free.
///
/// @code
/// Agreement a("DistributedAttention");
/// a.add("the batch (fingerprint)", batch.fingerprint(), Agreement::kHash).add("mask.window", mask.window);
/// a.run(world, refused);   // throws on every rank, or returns with every rank agreeing
/// @endcode
class Agreement {
 public:
  static constexpr std::size_t kMaxWords = 48;
  static constexpr std::size_t kReasonBytes = 300;
  enum Kind : std::uint8_t { kInteger, kDouble, kHash, kOwn };

  /// What one rank sends: trivially copyable, the same size on every rank.
  struct Record {
    std::uint32_t words = 0;
    std::int32_t refused = 0;
    std::array<std::uint64_t, kMaxWords> value{};
    std::array<char, kReasonBytes> reason{};

    [[nodiscard]] std::string why() const { return {reason.data(), strnlen(reason.data(), reason.size())}; }
  };

  /// `where` starts every message ("DistributedAttention", "ChunkedAttention::forward", ...); a peer's
  /// refusal reads "rank R refused <refused> before any communication: <its reason>".
  explicit Agreement(std::string_view where, std::string_view refused = "its arguments") noexcept
      : where_(where), refused_(refused) {}

  /// Adds a word every rank must hold equal (names: string literals or strings that outlive the call).
  Agreement& add(std::string_view name, std::int64_t value) {
    return push(name, static_cast<std::uint64_t>(value), kInteger);
  }
  Agreement& add(std::string_view name, std::uint64_t value, Kind kind) { return push(name, value, kind); }
  Agreement& add(std::string_view name, double value) {
    return push(name, std::bit_cast<std::uint64_t>(value), kDouble);
  }
  /// Adds a word exchanged but not compared (read back with record(r).value[index]).
  std::size_t add_own(std::string_view name, std::int64_t value) {
    push(name, static_cast<std::uint64_t>(value), kOwn);
    return count_ - 1;
  }
  [[nodiscard]] std::size_t size() const noexcept { return count_; }

  /// The all_gather and the checks above. `refused`: this rank's exception from its local checks, or null.
  /// `scratch` holds the gathered records (callers keep it to allocate only on the first call).
  template <class World>
  void run(World& world, const std::exception_ptr& refused, std::vector<Record>& scratch) {
    if (overflow_)
      throw std::logic_error(std::string(where_) + ": an agreement has more than " + std::to_string(kMaxWords) +
                             " words");
    mine_.words = static_cast<std::uint32_t>(count_);
    if (refused) {
      mine_.refused = 1;
      std::string what = "unknown exception";
      try {
        std::rethrow_exception(refused);
      } catch (const std::exception& e) {
        what = e.what();
      } catch (...) {
      }
      std::strncpy(mine_.reason.data(), what.c_str(), mine_.reason.size() - 1);
    }
    scratch.resize(static_cast<std::size_t>(world.size()));
    world.all_gather(std::as_bytes(std::span(&mine_, 1)), std::as_writable_bytes(std::span(scratch)));
    gathered_ = scratch;
    if (refused) std::rethrow_exception(refused);
    for (std::size_t r = 0; r < scratch.size(); ++r)
      if (scratch[r].refused != 0)
        throw Error(Errc::kPeerFailed, std::string(where_) + ": rank " + std::to_string(r) + " refused " +
                                           std::string(refused_) + " before any communication: " + scratch[r].why());
    const int me = world.rank();
    for (std::size_t r = 0; r < scratch.size(); ++r) {
      const Record& other = scratch[r];
      if (other.words != mine_.words)
        fail(static_cast<int>(r), me, "the call (a different number of agreed words: another call or version)",
             std::to_string(other.words), std::to_string(mine_.words));
      for (std::size_t i = 0; i < count_; ++i)
        if (kinds_[i] != kOwn && other.value[i] != mine_.value[i])
          fail(static_cast<int>(r), me, names_[i], show(other.value[i], kinds_[i]), show(mine_.value[i], kinds_[i]));
    }
  }

  /// What rank r sent (after run).
  [[nodiscard]] const Record& record(int r) const { return gathered_[static_cast<std::size_t>(r)]; }

 private:
  Agreement& push(std::string_view name, std::uint64_t value, Kind kind) {
    if (count_ == kMaxWords) {
      overflow_ = true;
      return *this;
    }
    mine_.value[count_] = value;
    names_[count_] = name;
    kinds_[count_] = kind;
    ++count_;
    return *this;
  }
  static std::string show(std::uint64_t v, Kind kind) {
    switch (kind) {
      case kDouble:
        return std::to_string(std::bit_cast<double>(v));
      case kHash:
        return std::to_string(v);
      default:
        return std::to_string(static_cast<std::int64_t>(v));
    }
  }
  [[noreturn]] void fail(int r, int me, std::string_view what, const std::string& theirs,
                         const std::string& mine) const {
    throw Error(Errc::kMismatch, std::string(where_) + ": rank " + std::to_string(r) + " and rank " +
                                     std::to_string(me) + " disagree on " + std::string(what) + ": " + theirs + " vs " +
                                     mine);
  }

  std::string_view where_, refused_;
  Record mine_{};
  std::array<std::string_view, kMaxWords> names_{};
  std::array<Kind, kMaxWords> kinds_{};
  std::size_t count_ = 0;
  std::span<const Record> gathered_;
  bool overflow_ = false;
};

}  // namespace seqpar::runtime
