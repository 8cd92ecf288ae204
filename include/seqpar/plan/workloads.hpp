// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

#include "seqpar/core/error.hpp"

/// Document-length mixes of the workloads the papers train on, for the cost model, the replays
/// (bench/replay/) and seqpar-plan.
///
/// A distribution is named by a string: "single", "fixed:<len>", "uniform:<lo>:<hi>", or one of the
/// corpus-shaped mixes below. No paper publishes its length histogram, so the corpus mixes are
/// lognormals (or mixtures) fitted to what the papers (BASP, HSAP, FlashCP, DPP, WLB-LLM) say of their data;
/// each says where its numbers come from ([I] = our inference, not a published figure).
///
/// Determinism: the draws use std::mt19937_64 (its output is fixed by the standard) and transforms
/// written here (Box-Muller, rejection for integers), not std::*_distribution, whose output differs
/// between standard libraries. The transforms call std::log, std::exp, std::sqrt and std::cos; libms
/// agree on these to an ulp, which changes a rounded length only at an exact .5 tie.
///
/// @code
/// auto lengths = plan::workloads::sample_lengths("fineweb", 32768, 7);  // sums to 32768
/// DocumentBatch batch = DocumentBatch::single(lengths);
/// @endcode
namespace seqpar::plan::workloads {

namespace detail {

/// Longest document the corpus mixes produce: seeds.md's "tail to 128K" (FlashCP's 128K context).
inline constexpr std::int64_t kMaxDocument = 131072;

/// Uniform in [0, 1) from the top 53 bits (every value a multiple of 2^-53).
[[nodiscard]] inline double unit(std::mt19937_64& g) {
  return static_cast<double>(g() >> 11) * 0x1.0p-53;
}

/// Standard normal by Box-Muller (one of the pair; the other is dropped to keep the stream simple).
[[nodiscard]] inline double normal(std::mt19937_64& g) {
  const double u1 = 1.0 - unit(g);  // (0, 1]: log is finite
  const double u2 = unit(g);
  constexpr double kTwoPi = 6.283185307179586476925286766559;
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(kTwoPi * u2);
}

/// Integer uniform in [lo, hi], unbiased (rejection of the incomplete last block of 2^64).
[[nodiscard]] inline std::int64_t uniform_int(std::mt19937_64& g, std::int64_t lo, std::int64_t hi) {
  const std::uint64_t range = static_cast<std::uint64_t>(hi - lo) + 1;
  const std::uint64_t limit =
      std::numeric_limits<std::uint64_t>::max() - std::numeric_limits<std::uint64_t>::max() % range;
  std::uint64_t x = g();
  while (x >= limit) x = g();
  return lo + static_cast<std::int64_t>(x % range);
}

[[nodiscard]] inline double lognormal(std::mt19937_64& g, double median, double sigma) {
  return median * std::exp(sigma * normal(g));
}

enum class Kind : std::uint8_t { kSingle, kFixed, kUniform, kLognormal, kLongtail };

/// A parsed distribution: a family and its parameters.
struct Spec {
  Kind kind = Kind::kSingle;
  std::int64_t a = 0, b = 0;         // fixed: a = length; uniform: [a, b]
  double median = 0.0, sigma = 0.0;  // lognormal families
};

/// One length from `spec` (not rounded or capped; "single" has none to draw).
[[nodiscard]] inline double draw(const Spec& spec, std::mt19937_64& g) {
  switch (spec.kind) {
    case Kind::kFixed:
      return static_cast<double>(spec.a);
    case Kind::kUniform:
      return static_cast<double>(uniform_int(g, spec.a, spec.b));
    case Kind::kLognormal:
      return lognormal(g, spec.median, spec.sigma);
    case Kind::kLongtail:
      return unit(g) < 0.1 ? static_cast<double>(uniform_int(g, spec.a, spec.b))
                           : lognormal(g, spec.median, spec.sigma);
    case Kind::kSingle:
      break;
  }
  return 0.0;
}

[[nodiscard]] inline std::string known_list() {
  return "single, fixed:<len>, uniform:<lo>:<hi>, lognormal, pile, redpajama, longtail, fineweb, ultrachat, "
         "commoncrawl, github";
}

[[noreturn]] inline void bad_distribution(std::string_view name, std::string_view why) {
  seqpar::detail::throw_invalid("plan::workloads::sample_lengths", "distribution", std::string(name), why);
}

/// Parses a positive integer field of a parameterised name, or throws naming the whole name.
[[nodiscard]] inline std::int64_t parse_length(std::string_view field, std::string_view name) {
  std::int64_t v = 0;
  const auto [end, ec] = std::from_chars(field.data(), field.data() + field.size(), v);
  if (field.empty() || ec != std::errc() || end != field.data() + field.size() || v < 1)
    bad_distribution(name, "'" + std::string(field) + "' is not a length >= 1");
  return v;
}

[[nodiscard]] inline Spec parse(std::string_view name) {
  std::string n(name);
  std::transform(n.begin(), n.end(), n.begin(), [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  const std::string_view v(n);
  Spec s;
  if (v == "single") return s;
  if (v.starts_with("fixed:")) {
    s.kind = Kind::kFixed;
    s.a = parse_length(v.substr(6), name);
    return s;
  }
  if (v.starts_with("uniform:")) {
    const std::string_view rest = v.substr(8);
    const auto colon = rest.find(':');
    if (colon == std::string_view::npos) bad_distribution(name, "expected uniform:<lo>:<hi>");
    s.kind = Kind::kUniform;
    s.a = parse_length(rest.substr(0, colon), name);
    s.b = parse_length(rest.substr(colon + 1), name);
    if (s.b < s.a) bad_distribution(name, "needs lo <= hi");
    return s;
  }
  s.kind = Kind::kLognormal;
  // The seeds digest's FlashCP/comm_volume mix: "Pile / RedPajama-like", median 2K, sigma 1.
  if (v == "lognormal") return s.median = 2048, s.sigma = 1.0, s;
  // [I] Pile: many short web / PubMed / email documents and a long tail of books, arXiv and code; seeds.md
  // says only "approx. lognormal, median ~1-4K, tail to 128K". Median 1K with a wide sigma puts ~7% of
  // the documents over 8K and ~0.03% at the 128K cap.
  if (v == "pile") return s.median = 1024, s.sigma = 1.4, s;
  // [I] RedPajama (v1): the upper half of seeds.md's median range (its books and arXiv slices are long),
  // median 3K, sigma 1.2.
  if (v == "redpajama") return s.median = 3072, s.sigma = 1.2, s;
  // [I] FineWeb: web pages, "many <= 2K" (seeds.md, HSAP workload): median 512, sigma 0.9 puts ~94% at
  // or under 2K.
  if (v == "fineweb") return s.median = 512, s.sigma = 0.9, s;
  // [I] UltraChat: multi-turn dialogues, "mostly <= 4K" (seeds.md, HSAP workload): median 1280, sigma
  // 0.6 puts ~97% at or under 4K.
  if (v == "ultrachat") return s.median = 1280, s.sigma = 0.6, s;
  // DPP's two corpora (InfiniPipe, seeds.md section 4). The paper's text: GitHub has most sequences under
  // 16K and < 0.6% over 64K [R]; its Fig. 1(b) labels the shortest bin (< 2K) 69.9% for CommonCrawl and
  // 59.2% for GitHub [R, read from a text extraction of the figure; which label is which assumed from
  // the legend's order]. GitHub: lognormal through 59.2% under 2K and 0.5% over 64K, median 1450,
  // sigma 1.48 (5% over 16K). CommonCrawl: 69.9% under 2K; its tail is not given, so GitHub's sigma is
  // assumed [I]: median 950 (2.7% over 16K, 0.4% over 48K).
  if (v == "commoncrawl") return s.median = 950, s.sigma = 1.48, s;
  if (v == "github") return s.median = 1450, s.sigma = 1.48, s;
  // WLB-LLM-like long tail (comm_volume's mix; seeds.md FlashCP workload (a)): 90% of documents
  // lognormal around 1K (sigma 1), 10% uniform in [16K, 64K].
  if (v == "longtail") return s.kind = Kind::kLongtail, s.median = 1024, s.sigma = 1.0, s.a = 16384, s.b = 65536, s;
  bad_distribution(name, "is not a known distribution (" + known_list() + ")");
}

}  // namespace detail

/// Names of the document-length distributions sample_lengths knows, for --help and error messages.
[[nodiscard]] inline std::vector<std::string> distribution_names() {
  return {"single",   "fixed:<len>", "uniform:<lo>:<hi>", "lognormal",   "pile",  "redpajama",
          "longtail", "fineweb",     "ultrachat",         "commoncrawl", "github"};
}

/// Document lengths summing exactly to `tokens`, drawn from the named distribution with `seed`
/// (deterministic for a given seed). Documents are drawn in order until the tokens run out; the last
/// one is cut to fit, as a packer cuts the document that overflows a sequence. Throws
/// std::invalid_argument naming the argument and value (unknown name, malformed parameters, tokens < 1).
[[nodiscard]] inline std::vector<std::int64_t> sample_lengths(std::string_view distribution, std::int64_t tokens,
                                                              std::uint64_t seed) {
  seqpar::detail::require(tokens >= 1, "plan::workloads::sample_lengths", "tokens", tokens, "must be >= 1");
  const detail::Spec spec = detail::parse(distribution);
  if (spec.kind == detail::Kind::kSingle) return {tokens};
  std::mt19937_64 g(seed);
  std::vector<std::int64_t> out;
  for (std::int64_t left = tokens; left > 0;) {
    const double x = detail::draw(spec, g);
    const bool capped = spec.kind == detail::Kind::kLognormal || spec.kind == detail::Kind::kLongtail;
    const double cap = capped ? static_cast<double>(detail::kMaxDocument) : static_cast<double>(left);
    const auto len = std::clamp<std::int64_t>(std::llround(std::min(x, cap)), 1, left);
    out.push_back(len);
    left -= len;
  }
  return out;
}

/// `count` sequences of one document each, drawn from the named distribution with `seed` and truncated
/// at `max_length` (a corpus cut at the context length, as DPP's global batches of 512 sequences are);
/// "single" gives `count` sequences of max_length. Deterministic like sample_lengths. Throws
/// std::invalid_argument naming the argument and value.
[[nodiscard]] inline std::vector<std::int64_t> sample_sequences(std::string_view distribution, int count,
                                                                std::int64_t max_length, std::uint64_t seed) {
  constexpr const char* where = "plan::workloads::sample_sequences";
  seqpar::detail::require(count >= 1, where, "count", count, "must be >= 1");
  seqpar::detail::require(max_length >= 1, where, "max_length", max_length, "must be >= 1");
  const detail::Spec spec = detail::parse(distribution);
  std::mt19937_64 g(seed);
  std::vector<std::int64_t> out(static_cast<std::size_t>(count), max_length);
  if (spec.kind == detail::Kind::kSingle) return out;
  for (std::int64_t& len : out)
    len = std::clamp<std::int64_t>(std::llround(std::min(detail::draw(spec, g), static_cast<double>(max_length))), 1,
                                   max_length);
  return out;
}

}  // namespace seqpar::plan::workloads
