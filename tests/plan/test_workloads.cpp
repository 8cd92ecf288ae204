// SPDX-License-Identifier: Apache-2.0
#include <doctest/doctest.h>

#include "support/expect_error.hpp"

#include <seqpar/plan/workloads.hpp>

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <string>
#include <vector>

using namespace seqpar;
namespace workloads = seqpar::plan::workloads;

namespace {
using test::invalid_message;

std::int64_t sum(const std::vector<std::int64_t>& v) {
  return std::accumulate(v.begin(), v.end(), std::int64_t{0});
}

double median(std::vector<std::int64_t> v) {
  std::sort(v.begin(), v.end());
  return static_cast<double>(v[v.size() / 2]);
}

// The names a user types: parameterised ones filled in.
const std::vector<std::string> kConcrete = {"single",    "fixed:1000",  "uniform:16:4096", "lognormal",
                                            "pile",      "redpajama",   "longtail",        "fineweb",
                                            "ultrachat", "commoncrawl", "github"};
}  // namespace

TEST_SUITE("plan") {
  TEST_CASE("workloads: every distribution sums exactly to the tokens, documents >= 1") {
    CHECK(workloads::distribution_names().size() == kConcrete.size());
    for (const std::string& name : kConcrete)
      for (const std::int64_t tokens :
           {std::int64_t{1}, std::int64_t{7}, std::int64_t{32768}, std::int64_t{131072}, std::int64_t{1000003}}) {
        CAPTURE(name);
        CAPTURE(tokens);
        const auto lengths = workloads::sample_lengths(name, tokens, 42);
        CHECK(sum(lengths) == tokens);
        CHECK(std::all_of(lengths.begin(), lengths.end(), [](std::int64_t l) { return l >= 1; }));
        if (name != "single")  // the corpus mixes stop at 128K; fixed and uniform at their parameters
          CHECK(std::all_of(lengths.begin(), lengths.end(), [](std::int64_t l) { return l <= 131072; }));
      }
  }

  TEST_CASE("workloads: a seed gives the same lengths every time, another seed others") {
    for (const std::string& name : kConcrete) {
      CAPTURE(name);
      CHECK(workloads::sample_lengths(name, 131072, 7) == workloads::sample_lengths(name, 131072, 7));
      if (name != "single" && name != "fixed:1000")
        CHECK(workloads::sample_lengths(name, 131072, 7) != workloads::sample_lengths(name, 131072, 8));
    }
    // Pinned draws: the transforms are ours on top of mt19937_64, so they must not change across
    // standard libraries (or across edits that would silently change every replay).
    // The integer path uses mt19937_64 and integer arithmetic only: exact on every platform.
    CHECK(workloads::sample_lengths("uniform:1:100", 300, 1) ==
          std::vector<std::int64_t>{29, 63, 31, 47, 85, 10, 29, 6});
    const auto fixed = workloads::sample_lengths("fixed:1000", 3500, 0);
    CHECK(fixed == std::vector<std::int64_t>{1000, 1000, 1000, 500});
    CHECK(workloads::sample_lengths("single", 12345, 3) == std::vector<std::int64_t>{12345});
    CHECK(workloads::sample_lengths("FineWeb", 4096, 5) == workloads::sample_lengths("fineweb", 4096, 5));
  }

  TEST_CASE("workloads: the mixes have the shapes their comments claim") {
    // Medians within 20% of the stated ones over ~a thousand documents (the last, cut document aside).
    const auto check_median = [](const char* name, double expected) {
      auto v = workloads::sample_lengths(name, 4'000'000, 11);
      v.pop_back();
      CAPTURE(name);
      CHECK(median(v) == doctest::Approx(expected).epsilon(0.2));
    };
    check_median("lognormal", 2048);
    check_median("pile", 1024);
    check_median("redpajama", 3072);
    check_median("fineweb", 512);
    check_median("ultrachat", 1280);
    check_median("commoncrawl", 950);
    check_median("github", 1450);
    // longtail: about 10% of the documents in [16K, 64K].
    auto lt = workloads::sample_lengths("longtail", 20'000'000, 3);
    lt.pop_back();
    const auto longs = std::count_if(lt.begin(), lt.end(), [](std::int64_t l) { return l >= 16384 && l <= 65536; });
    CHECK(static_cast<double>(longs) / static_cast<double>(lt.size()) == doctest::Approx(0.1).epsilon(0.25));
    const auto u = workloads::sample_lengths("uniform:100:200", 1'000'000, 9);
    CHECK(*std::min_element(u.begin(), u.end() - 1) >= 100);
    CHECK(*std::max_element(u.begin(), u.end()) <= 200);
  }

  TEST_CASE("workloads: sequences for DPP's corpora, truncated at the context length") {
    const auto gh = workloads::sample_sequences("github", 20000, 65536, 5);
    CHECK(gh.size() == 20000);
    CHECK(gh == workloads::sample_sequences("GitHub", 20000, 65536, 5));
    CHECK(*std::max_element(gh.begin(), gh.end()) == 65536);  // the tail is cut, not dropped
    const auto share = [](const std::vector<std::int64_t>& v, auto pred) {
      return static_cast<double>(std::count_if(v.begin(), v.end(), pred)) / static_cast<double>(v.size());
    };
    // The figures the mixes were fitted to (plan/workloads.hpp): GitHub 59.2% under 2K and < 0.6% at
    // 64K and over (the truncated ones), CommonCrawl 69.9% under 2K.
    CHECK(share(gh, [](std::int64_t l) { return l < 2048; }) == doctest::Approx(0.592).epsilon(0.03));
    CHECK(share(gh, [](std::int64_t l) { return l >= 65536; }) < 0.006);
    CHECK(share(gh, [](std::int64_t l) { return l < 16384; }) > 0.9);
    const auto cc = workloads::sample_sequences("commoncrawl", 20000, 49152, 5);
    CHECK(share(cc, [](std::int64_t l) { return l < 2048; }) == doctest::Approx(0.699).epsilon(0.03));
    CHECK(workloads::sample_sequences("single", 3, 100, 0) == std::vector<std::int64_t>{100, 100, 100});
    CHECK(workloads::sample_sequences("fixed:300", 2, 100, 0) == std::vector<std::int64_t>{100, 100});
    CHECK(invalid_message([] { (void)workloads::sample_sequences("github", 0, 100, 0); }).find("count = 0") !=
          std::string::npos);
    CHECK(invalid_message([] { (void)workloads::sample_sequences("github", 4, 0, 0); }).find("max_length = 0") !=
          std::string::npos);
  }

  TEST_CASE("workloads: bad names and token counts throw, naming the value") {
    std::string m = invalid_message([] { (void)workloads::sample_lengths("zipf", 100, 0); });
    CHECK(m.find("distribution = zipf") != std::string::npos);
    CHECK(m.find("fineweb") != std::string::npos);  // lists the known ones
    m = invalid_message([] { (void)workloads::sample_lengths("lognormal", 0, 0); });
    CHECK(m.find("tokens = 0") != std::string::npos);
    m = invalid_message([] { (void)workloads::sample_lengths("single", -5, 0); });
    CHECK(m.find("tokens = -5") != std::string::npos);
    m = invalid_message([] { (void)workloads::sample_lengths("fixed:0", 100, 0); });
    CHECK(m.find("distribution = fixed:0") != std::string::npos);
    m = invalid_message([] { (void)workloads::sample_lengths("fixed:abc", 100, 0); });
    CHECK(m.find("'abc'") != std::string::npos);
    m = invalid_message([] { (void)workloads::sample_lengths("uniform:10", 100, 0); });
    CHECK(m.find("distribution = uniform:10") != std::string::npos);
    m = invalid_message([] { (void)workloads::sample_lengths("uniform:10:5", 100, 0); });
    CHECK(m.find("lo <= hi") != std::string::npos);
  }
}
