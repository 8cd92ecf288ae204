// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

#include <array>
#include <cctype>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <limits>
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <system_error>

#include "seqpar/core/error.hpp"
#include "seqpar/replay/hardware.hpp"

namespace seqpar::replay {

/// A HardwareProfile as one flat JSON object (what bench/calibrate --profile-out writes and a planner
/// or `seqpar_plan --profile FILE` reads back). Links are flattened to `intra_bandwidth`,
/// `intra_latency`, `inter_bandwidth`, `inter_latency`, `host_bandwidth`, `host_latency`; every other key
/// is the member's name. Numbers are
/// written with 17 significant digits so that `profile_from_json(to_json(p))` gives p back exactly.
///
/// @code
/// replay::HardwareProfile hw = replay::load_profile("build/release/bench/profile.json");
/// replay::SimulationOptions options{.hardware = hw};
/// @endcode
[[nodiscard]] inline std::string to_json(const HardwareProfile& p) {
  std::string name;
  for (char c : p.name) {
    if (c == '"' || c == '\\') name += '\\';
    if (static_cast<unsigned char>(c) >= 0x20) name += c;  // control characters have no place in a name
  }
  const auto num = [](double x) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%.17g", x);
    return std::string(buf);
  };
  std::string s = "{\n  \"name\": \"" + name + "\"";
  const auto add = [&](const char* key, const std::string& value) {
    s += ",\n  \"" + std::string(key) + "\": " + value;
  };
  add("peak_flops", num(p.peak_flops));
  add("gemm_efficiency", num(p.gemm_efficiency));
  add("attention_efficiency", num(p.attention_efficiency));
  add("attention_tile", num(p.attention_tile));
  add("attention_tile_overhead", num(p.attention_tile_overhead));
  add("attention_half_length", num(p.attention_half_length));
  add("attention_backward_factor", num(p.attention_backward_factor));
  add("kernel_launch", num(p.kernel_launch));
  add("hbm_bandwidth", num(p.hbm_bandwidth));
  add("intra_bandwidth", num(p.intra.bandwidth));
  add("intra_latency", num(p.intra.latency));
  add("inter_bandwidth", num(p.inter.bandwidth));
  add("inter_latency", num(p.inter.latency));
  add("ranks_per_node", std::to_string(p.ranks_per_node));
  add("nics_per_node", std::to_string(p.nics_per_node));
  add("memory_bytes", num(p.memory_bytes));
  add("value_bytes", std::to_string(p.value_bytes));
  add("cores_per_node", std::to_string(p.cores_per_node));
  add("collective_latency", num(p.collective_latency));
  add("peer_latency_intra", num(p.peer_latency_intra));
  add("peer_latency_inter", num(p.peer_latency_inter));
  add("copy_launch", num(p.copy_launch));
  add("nvlink_domain", std::to_string(p.nvlink_domain));
  add("host_bandwidth", num(p.host.bandwidth));
  add("host_latency", num(p.host.latency));
  return s + "\n}\n";
}

}  // namespace seqpar::replay

// In seqpar::detail, not seqpar::replay::detail: a replay::detail namespace would hide seqpar::detail from the
// `detail::require` calls of the replay headers included after this one.
namespace seqpar::detail {

/// Reads the flat object to_json writes: string values for "name", numbers elsewhere, every key exactly
/// once. Not a general JSON parser (no nesting, arrays, booleans or null): a profile has none of them.
class ProfileReader {
 public:
  explicit ProfileReader(std::string_view text) : text_(text) {}

  replay::HardwareProfile read() {
    replay::HardwareProfile p;
    std::array<bool, kKeys.size()> seen{};
    expect('{');
    skip_space();
    if (peek() == '}') fail("object", "{}", "is empty");
    for (;;) {
      const std::string key = string_token("a key");
      expect(':');
      std::size_t k = 0;
      while (k < kKeys.size() && kKeys[k] != key) ++k;
      if (k == kKeys.size()) fail("key", key, "is not a HardwareProfile field");
      if (seen[k]) fail("key", key, "appears twice");
      seen[k] = true;
      if (key == "name")
        p.name = string_token("the value of \"name\"");
      else
        assign(p, key, number(key));
      skip_space();
      if (peek() == ',') {
        ++at_;
        continue;
      }
      expect('}');
      break;
    }
    skip_space();
    if (at_ != text_.size()) fail("text after the object", std::string(text_.substr(at_, 20)), "is not allowed");
    for (std::size_t k = 0; k < kRequiredKeys; ++k)
      if (!seen[k]) fail("key", std::string(kKeys[k]), "is missing");
    p.validate("replay::profile_from_json");
    return p;
  }

 private:
  // The fixed costs and the NVLink domains (issue 16) came later: profiles written before them load with 0
  // (whole-node NVLink, no host link), as they were priced.
  static constexpr std::size_t kRequiredKeys = 19;
  static constexpr std::array<std::string_view, 26> kKeys = {"name",
                                                             "peak_flops",
                                                             "gemm_efficiency",
                                                             "attention_efficiency",
                                                             "attention_tile",
                                                             "attention_tile_overhead",
                                                             "attention_half_length",
                                                             "attention_backward_factor",
                                                             "kernel_launch",
                                                             "hbm_bandwidth",
                                                             "intra_bandwidth",
                                                             "intra_latency",
                                                             "inter_bandwidth",
                                                             "inter_latency",
                                                             "ranks_per_node",
                                                             "nics_per_node",
                                                             "memory_bytes",
                                                             "value_bytes",
                                                             "cores_per_node",
                                                             "collective_latency",
                                                             "peer_latency_intra",
                                                             "peer_latency_inter",
                                                             "copy_launch",
                                                             "nvlink_domain",
                                                             "host_bandwidth",
                                                             "host_latency"};

  [[noreturn]] void fail(std::string_view what, const std::string& value, std::string_view why) const {
    throw_invalid("replay::profile_from_json", std::string(what) + " (at offset " + std::to_string(at_) + ")",
                  "'" + value + "'", why);
  }
  void skip_space() {
    while (at_ < text_.size() && std::isspace(static_cast<unsigned char>(text_[at_]))) ++at_;
  }
  [[nodiscard]] char peek() const { return at_ < text_.size() ? text_[at_] : '\0'; }
  void expect(char c) {
    skip_space();
    if (peek() != c)
      fail("character", at_ < text_.size() ? std::string(1, text_[at_]) : "end of text",
           std::string("found where '") + c + "' was expected");
    ++at_;
  }
  std::string string_token(std::string_view what) {
    skip_space();
    if (peek() != '"') fail(what, std::string(text_.substr(at_, 20)), "must be a double-quoted string");
    ++at_;
    std::string s;
    while (at_ < text_.size() && text_[at_] != '"') {
      if (text_[at_] == '\\' && at_ + 1 < text_.size()) ++at_;  // to_json escapes only '"' and '\'
      s += text_[at_++];
    }
    if (at_ == text_.size()) fail(what, s, "is not terminated by '\"'");
    ++at_;
    return s;
  }
  double number(const std::string& key) {
    skip_space();
    const char* first = text_.data() + at_;
    const char* last = text_.data() + text_.size();
    double x = 0;
    const auto [end, ec] = std::from_chars(first, last, x);
    if (ec != std::errc{} || !std::isfinite(x)) {
      std::size_t len = 0;
      while (at_ + len < text_.size() && text_[at_ + len] != ',' && text_[at_ + len] != '}' && len < 20) ++len;
      fail("value of \"" + key + "\"", std::string(text_.substr(at_, len)), "is not a finite number");
    }
    at_ += static_cast<std::size_t>(end - first);
    return x;
  }
  void integer(const std::string& key, double x, int& out) const {
    if (x != std::floor(x) || std::fabs(x) > std::numeric_limits<int>::max())
      throw_invalid("replay::profile_from_json", key, x, "must be an integer");
    out = static_cast<int>(x);
  }
  void assign(replay::HardwareProfile& p, const std::string& key, double x) const {
    if (key == "peak_flops")
      p.peak_flops = x;
    else if (key == "gemm_efficiency")
      p.gemm_efficiency = x;
    else if (key == "attention_efficiency")
      p.attention_efficiency = x;
    else if (key == "attention_tile")
      p.attention_tile = x;
    else if (key == "attention_tile_overhead")
      p.attention_tile_overhead = x;
    else if (key == "attention_half_length")
      p.attention_half_length = x;
    else if (key == "attention_backward_factor")
      p.attention_backward_factor = x;
    else if (key == "kernel_launch")
      p.kernel_launch = x;
    else if (key == "hbm_bandwidth")
      p.hbm_bandwidth = x;
    else if (key == "intra_bandwidth")
      p.intra.bandwidth = x;
    else if (key == "intra_latency")
      p.intra.latency = x;
    else if (key == "inter_bandwidth")
      p.inter.bandwidth = x;
    else if (key == "inter_latency")
      p.inter.latency = x;
    else if (key == "ranks_per_node")
      integer(key, x, p.ranks_per_node);
    else if (key == "nics_per_node")
      integer(key, x, p.nics_per_node);
    else if (key == "memory_bytes")
      p.memory_bytes = x;
    else if (key == "value_bytes")
      integer(key, x, p.value_bytes);
    else if (key == "cores_per_node")
      integer(key, x, p.cores_per_node);
    else if (key == "collective_latency")
      p.collective_latency = x;
    else if (key == "peer_latency_intra")
      p.peer_latency_intra = x;
    else if (key == "peer_latency_inter")
      p.peer_latency_inter = x;
    else if (key == "copy_launch")
      p.copy_launch = x;
    else if (key == "nvlink_domain")
      integer(key, x, p.nvlink_domain);
    else if (key == "host_bandwidth")
      p.host.bandwidth = x;
    else if (key == "host_latency")
      p.host.latency = x;
  }

  std::string_view text_;
  std::size_t at_ = 0;
};

}  // namespace seqpar::detail

namespace seqpar::replay {

/// The profile `text` describes (to_json's format). Bad input throws std::invalid_argument naming the key or
/// the offending text; a profile that parses but fails HardwareProfile::validate throws naming the field.
[[nodiscard]] inline HardwareProfile profile_from_json(std::string_view text) {
  return detail::ProfileReader(text).read();
}

/// profile_from_json of the file at `path`; a file that cannot be read throws std::invalid_argument naming
/// the path, bad content names the path and the key.
[[nodiscard]] inline HardwareProfile load_profile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) detail::throw_invalid("replay::load_profile", "path", path, "cannot be opened for reading");
  std::ostringstream text;
  text << in.rdbuf();
  try {
    return profile_from_json(text.str());
  } catch (const std::invalid_argument& e) {
    throw std::invalid_argument("replay::load_profile: " + path + ": " + e.what());
  }
}

}  // namespace seqpar::replay
