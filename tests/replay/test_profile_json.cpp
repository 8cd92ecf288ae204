// SPDX-License-Identifier: Apache-2.0
// replay::to_json / profile_from_json / load_profile: the profile bench/calibrate writes reads back exactly,
// and bad input names what is wrong.
#include <doctest/doctest.h>

#include "support/expect_error.hpp"

#include <seqpar/replay/profile_json.hpp>

#include <cstdio>
#include <fstream>
#include <string>

using namespace seqpar;

namespace {
using test::invalid_message;

replay::HardwareProfile measured_like() {
  replay::HardwareProfile p;
  p.name = "this \"machine\" \\ 2 cores";
  p.peak_flops = 1.234567890123e11;
  p.attention_efficiency = 0.4321;
  p.attention_tile = 64;
  p.attention_tile_overhead = 0.37;
  p.attention_half_length = 187.25;
  p.attention_backward_factor = 0.61;
  p.kernel_launch = 3.3e-6;
  p.hbm_bandwidth = 9.87654321e9;
  p.intra = {5.5e9, 4.1e-6};
  p.inter = {1.25e9, 2e-5};
  p.ranks_per_node = 8;
  p.nics_per_node = 1;
  p.memory_bytes = 8e9;
  p.value_bytes = 4;
  p.cores_per_node = 2;
  p.collective_latency = 1.1e-5;
  p.peer_latency_intra = 2.5e-6;
  p.peer_latency_inter = 1.4e-5;
  p.copy_launch = 4e-6;
  return p;
}

void check_same(const replay::HardwareProfile& a, const replay::HardwareProfile& b) {
  CHECK(a.name == b.name);
  CHECK(a.peak_flops == b.peak_flops);  // exact: 17 significant digits round-trip a double
  CHECK(a.gemm_efficiency == b.gemm_efficiency);
  CHECK(a.attention_efficiency == b.attention_efficiency);
  CHECK(a.attention_tile == b.attention_tile);
  CHECK(a.attention_tile_overhead == b.attention_tile_overhead);
  CHECK(a.attention_half_length == b.attention_half_length);
  CHECK(a.attention_backward_factor == b.attention_backward_factor);
  CHECK(a.kernel_launch == b.kernel_launch);
  CHECK(a.hbm_bandwidth == b.hbm_bandwidth);
  CHECK(a.intra.bandwidth == b.intra.bandwidth);
  CHECK(a.intra.latency == b.intra.latency);
  CHECK(a.inter.bandwidth == b.inter.bandwidth);
  CHECK(a.inter.latency == b.inter.latency);
  CHECK(a.ranks_per_node == b.ranks_per_node);
  CHECK(a.nics_per_node == b.nics_per_node);
  CHECK(a.memory_bytes == b.memory_bytes);
  CHECK(a.value_bytes == b.value_bytes);
  CHECK(a.cores_per_node == b.cores_per_node);
  CHECK(a.collective_latency == b.collective_latency);
  CHECK(a.peer_latency_intra == b.peer_latency_intra);
  CHECK(a.peer_latency_inter == b.peer_latency_inter);
  CHECK(a.copy_launch == b.copy_launch);
  CHECK(a.nvlink_domain == b.nvlink_domain);
  CHECK(a.host.bandwidth == b.host.bandwidth);
  CHECK(a.host.latency == b.host.latency);
}

// to_json's text with one key's value replaced (the value runs to the end of its line, less a comma).
std::string with_value(const std::string& key, const std::string& value) {
  std::string s = replay::to_json(measured_like());
  const std::size_t at = s.find("\"" + key + "\": ");
  REQUIRE(at != std::string::npos);
  const std::size_t begin = at + key.size() + 4;
  std::size_t end = s.find('\n', begin);
  if (s[end - 1] == ',') --end;
  return s.replace(begin, end - begin, value);
}
}  // namespace

TEST_SUITE("replay") {
  TEST_CASE("replay::to_json round-trips a measured profile and every named profile exactly") {
    check_same(replay::profile_from_json(replay::to_json(measured_like())), measured_like());
    for (const std::string& name : replay::profiles::names()) {
      const replay::HardwareProfile p = replay::profiles::by_name(name);
      check_same(replay::profile_from_json(replay::to_json(p)), p);
    }
    // NVLink domains and the host link travel too (the named PCIe-pairs profile has them).
    const replay::HardwareProfile pairs =
        replay::profile_from_json(replay::to_json(replay::profiles::by_name("a100-40gb-pcie-pairs")));
    CHECK(pairs.nvlink_domain == 2);
    CHECK(pairs.host.bandwidth == 20e9);
  }

  TEST_CASE("replay::profile_from_json accepts any key order and whitespace") {
    std::string s = replay::to_json(measured_like());
    // Move "name" to the end: swap the first line with the rest.
    const std::size_t first = s.find('\n') + 1, second = s.find('\n', first) + 1;
    std::string name_line = s.substr(first, second - first);  // `  "name": "...",\n`
    s.erase(first, second - first);
    name_line.pop_back();  // '\n'
    name_line.pop_back();  // ','
    s.insert(s.rfind('\n', s.size() - 2), ",\n" + name_line);
    check_same(replay::profile_from_json(s), measured_like());
  }

  TEST_CASE("replay::profile_from_json names the key or the text that is wrong") {
    CHECK(invalid_message([] {
            (void)replay::profile_from_json(with_value("peak_flops", "\"fast\""));
          }).find("value of \"peak_flops\"") != std::string::npos);
    CHECK(invalid_message([] {
            (void)replay::profile_from_json(with_value("intra_latency", "abc"));
          }).find("'abc': is not a finite number") != std::string::npos);
    CHECK(invalid_message([] {
            (void)replay::profile_from_json(with_value("ranks_per_node", "2.5"));
          }).find("ranks_per_node = 2.5: must be an integer") != std::string::npos);
    // Parses, but the profile is invalid: validate names the field.
    CHECK(invalid_message([] {
            (void)replay::profile_from_json(with_value("hbm_bandwidth", "0"));
          }).find("hbm_bandwidth = 0: must be > 0") != std::string::npos);
    std::string unknown = replay::to_json(measured_like());
    unknown.insert(1, "\n  \"warp_size\": 32,");
    CHECK(invalid_message([&] {
            (void)replay::profile_from_json(unknown);
          }).find("'warp_size': is not a HardwareProfile field") != std::string::npos);
    std::string twice = replay::to_json(measured_like());
    twice.insert(1, "\n  \"value_bytes\": 4,");
    CHECK(invalid_message([&] { (void)replay::profile_from_json(twice); }).find("'value_bytes': appears twice") !=
          std::string::npos);
    std::string missing = replay::to_json(measured_like());
    const std::size_t at = missing.find("  \"cores_per_node\"");
    missing.erase(at, missing.find('\n', at) + 1 - at);  // the whole line, its comma too
    CHECK(invalid_message([&] { (void)replay::profile_from_json(missing); }).find("'cores_per_node': is missing") !=
          std::string::npos);
    // The fixed costs are optional (profiles written before them load with 0) but checked when given.
    std::string old = replay::to_json(measured_like());
    const std::size_t fixed = old.find(",\n  \"collective_latency\"");
    REQUIRE(fixed != std::string::npos);
    old.erase(fixed, old.rfind("\n}") - fixed);
    const replay::HardwareProfile before_fixed = replay::profile_from_json(old);
    CHECK(before_fixed.collective_latency == 0);
    CHECK(before_fixed.copy_launch == 0);
    CHECK(before_fixed.nvlink_domain == 0);  // and so are the NVLink domains: the whole node, no host link
    CHECK(before_fixed.host.bandwidth == 0);
    // NVLink domains that split a node need the link between them.
    CHECK(invalid_message([] {
            (void)replay::profile_from_json(with_value("nvlink_domain", "2"));
          }).find("host.bandwidth = 0: must be > 0 when nvlink_domain = 2") != std::string::npos);
    CHECK(invalid_message([] {
            (void)replay::profile_from_json(with_value("host_bandwidth", "-5"));
          }).find("host.bandwidth = -5: must be finite and >= 0") != std::string::npos);
    CHECK(invalid_message([] {
            (void)replay::profile_from_json(with_value("peer_latency_inter", "-1e-6"));
          }).find("peer_latency_inter = -1e-06: must be finite and >= 0") != std::string::npos);
    CHECK(invalid_message([] { (void)replay::profile_from_json(""); }).find("was expected") != std::string::npos);
    CHECK(invalid_message([] { (void)replay::profile_from_json("{}"); }).find("is empty") != std::string::npos);
    CHECK(invalid_message([] {
            (void)replay::profile_from_json(replay::to_json(measured_like()) + "x");
          }).find("text after the object") != std::string::npos);
    CHECK(invalid_message([] { (void)replay::profile_from_json("{\"name\": \"open"); }).find("not terminated") !=
          std::string::npos);
  }

  TEST_CASE("replay::load_profile reads a file and names the path on failure") {
    const std::string path = "seqpar_test_profile.json";
    {
      std::ofstream out(path);
      out << replay::to_json(measured_like());
    }
    check_same(replay::load_profile(path), measured_like());
    {
      std::ofstream out(path);
      out << with_value("value_bytes", "3");
    }
    const std::string bad = invalid_message([&] { (void)replay::load_profile(path); });
    CHECK(bad.find(path) != std::string::npos);
    CHECK(bad.find("value_bytes = 3") != std::string::npos);
    std::remove(path.c_str());
    CHECK(invalid_message([] {
            (void)replay::load_profile("/nonexistent/profile.json");
          }).find("path = /nonexistent/profile.json: cannot be opened") != std::string::npos);
  }
}
