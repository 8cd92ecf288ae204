// SPDX-License-Identifier: Apache-2.0
// Minimal JSON record writer shared by the benchmarks (flat records of numbers and strings).
#pragma once

#include <cmath>
#include <cstdio>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace seqpar::bench {

class JsonRecord {
 public:
  JsonRecord& add(const std::string& key, const std::string& value) {
    std::string escaped;
    for (char c : value) {
      if (c == '"' || c == '\\') escaped += '\\';
      escaped += c;
    }
    fields_.emplace_back(key, "\"" + escaped + "\"");
    return *this;
  }
  JsonRecord& add(const std::string& key, const char* value) { return add(key, std::string(value)); }
  JsonRecord& add(const std::string& key, bool value) {
    fields_.emplace_back(key, value ? "true" : "false");
    return *this;
  }
  template <class Number>
  requires std::is_arithmetic_v<Number> JsonRecord& add(const std::string& key, Number value) {
    std::ostringstream os;
    if constexpr (std::is_floating_point_v<Number>) {
      if (!std::isfinite(value)) {
        fields_.emplace_back(key, "null");
        return *this;
      }
      os.precision(6);
    }
    os << value;
    fields_.emplace_back(key, os.str());
    return *this;
  }
  [[nodiscard]] std::string str() const {
    std::string s = "{";
    for (std::size_t i = 0; i < fields_.size(); ++i)
      s += (i ? ", \"" : "\"") + fields_[i].first + "\": " + fields_[i].second;
    return s + "}";
  }

 private:
  std::vector<std::pair<std::string, std::string>> fields_;
};

/// Writes `records` as a JSON array to `path`; returns false (and says why) if the file cannot be written.
inline bool write_json(const std::string& path, const std::vector<JsonRecord>& records) {
  std::FILE* f = std::fopen(path.c_str(), "w");
  if (f == nullptr) {
    std::fprintf(stderr, "cannot write %s\n", path.c_str());
    return false;
  }
  std::fprintf(f, "[\n");
  for (std::size_t i = 0; i < records.size(); ++i)
    std::fprintf(f, "  %s%s\n", records[i].str().c_str(), i + 1 < records.size() ? "," : "");
  std::fprintf(f, "]\n");
  return std::fclose(f) == 0;
}

}  // namespace seqpar::bench
