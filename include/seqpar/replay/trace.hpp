// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

#include <cstdio>
#include <set>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "seqpar/core/error.hpp"
#include "seqpar/core/topology.hpp"

namespace seqpar::replay {

/// One interval of a simulated rank's timeline. Lane 0 is the rank's compute stream (kernels, copies,
/// waits), lane 1 its transfers. `label` points at a string literal.
struct TraceEvent {
  int rank = 0;
  int lane = 0;
  const char* label = "";
  double start_s = 0;
  double duration_s = 0;
  double amount = 0;  ///< FLOPs of a kernel, bytes of a transfer or copy
  int peer = -1;      ///< destination of a send
};

/// Events of a simulation, written as Chrome trace-event JSON (chrome://tracing, ui.perfetto.dev):
/// one process per node, two threads per rank (compute, comm), times in microseconds.
struct Trace {
  Topology topology;
  std::vector<TraceEvent> events;

  /// Appends `other`'s events shifted by `offset_s` (a layer replayed after another).
  void append(const Trace& other, double offset_s = 0.0) {
    for (TraceEvent e : other.events) {
      e.start_s += offset_s;
      events.push_back(e);
    }
  }

  /// Writes the trace to `path`; throws std::runtime_error naming the path if it cannot.
  void write(const std::string& path) const {
    std::FILE* f = std::fopen(path.c_str(), "w");
    if (f == nullptr) throw std::runtime_error("replay::Trace::write: cannot open '" + path + "' for writing");
    std::fputs("{\"displayTimeUnit\": \"ms\", \"traceEvents\": [\n", f);
    bool first = true;
    const auto sep = [&] {
      if (!first) std::fputs(",\n", f);
      first = false;
    };
    std::set<std::pair<int, int>> threads;
    for (const TraceEvent& e : events) threads.insert({e.rank, e.lane});
    std::set<int> nodes;
    for (const auto& [rank, lane] : threads) {
      const int node = topology.node_of(rank);
      if (nodes.insert(node).second) {
        sep();
        std::fprintf(f, R"({"name": "process_name", "ph": "M", "pid": %d, "args": {"name": "node %d"}})", node, node);
      }
      sep();
      std::fprintf(f, R"({"name": "thread_name", "ph": "M", "pid": %d, "tid": %d, "args": {"name": "rank %d %s"}})",
                   node, 2 * rank + lane, rank, lane == 0 ? "compute" : "comm");
    }
    for (const TraceEvent& e : events) {
      sep();
      std::fprintf(f,
                   R"({"name": "%s", "cat": "%s", "ph": "X", "pid": %d, "tid": %d, "ts": %.3f, "dur": %.3f, )"
                   R"("args": {"amount": %.6g, "peer": %d}})",
                   e.label, e.lane == 0 ? "compute" : "comm", topology.node_of(e.rank), 2 * e.rank + e.lane,
                   e.start_s * 1e6, e.duration_s * 1e6, e.amount, e.peer);
    }
    std::fputs("\n]}\n", f);
    if (std::fclose(f) != 0) throw std::runtime_error("replay::Trace::write: cannot write '" + path + "'");
  }
};

}  // namespace seqpar::replay
