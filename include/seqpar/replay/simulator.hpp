// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <span>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <variant>
#include <vector>

#include "seqpar/comm/program.hpp"
#include "seqpar/core/attention_shape.hpp"
#include "seqpar/core/error.hpp"
#include "seqpar/core/overloaded.hpp"
#include "seqpar/core/topology.hpp"
#include "seqpar/replay/costs.hpp"
#include "seqpar/replay/hardware.hpp"
#include "seqpar/replay/trace.hpp"
#include "seqpar/runtime/lowered_program.hpp"

namespace seqpar::replay {

struct SimulationOptions {
  HardwareProfile hardware;
  int value_bytes = 0;  ///< bytes of a Q/K/V/O element on the wire; 0 = hardware.value_bytes
  int lse_bytes = 4;
  bool trace = false;        ///< keep per-rank events for a Chrome/Perfetto trace
  int trace_max_ranks = 64;  ///< events are kept for ranks below this (traces of 1024 ranks are unreadable)
};

/// What one rank did during a replay. Times are seconds from the replay's time origin.
struct RankTiming {
  double start_s = 0, end_s = 0;
  double compute_s = 0;       ///< attention kernels
  double copy_s = 0;          ///< packing, unpacking, local copies, zero fills
  double comm_s = 0;          ///< transfers this rank took part in, summed (link busy time)
  double exposed_comm_s = 0;  ///< time blocked on a transfer or a collective (includes waiting for slower peers)
  std::uint64_t bytes_intra = 0, bytes_inter = 0;  ///< sent, by link class
  double staging_bytes = 0;                        ///< the program's staging buffers
  /// What the executor does on this rank: kernel calls, the slices and (query, key) pairs summed over
  /// query heads they cover, and partial results merged.
  std::int64_t kernel_calls = 0, slices = 0, head_pairs = 0, merges = 0;
};

namespace report_detail {
/// The largest f(rank) over per-rank records (0 for none): the reports' "slowest rank" figures.
template <class Rank, class F>
[[nodiscard]] auto max_over(const std::vector<Rank>& ranks, F f) noexcept {
  decltype(f(ranks.front())) m{};
  for (const Rank& r : ranks) m = std::max(m, f(r));
  return m;
}
}  // namespace report_detail

struct SimulationReport {
  double time_s = 0;  ///< slowest rank's end - earliest start
  std::vector<RankTiming> ranks;
  Trace trace;

  [[nodiscard]] double max_compute_s() const noexcept {
    return report_detail::max_over(ranks, [](const RankTiming& r) { return r.compute_s; });
  }
  /// max over ranks of compute / mean compute (1 = perfectly balanced).
  [[nodiscard]] double compute_imbalance() const noexcept {
    double sum = 0;
    for (const auto& r : ranks) sum += r.compute_s;
    return sum > 0 ? max_compute_s() * static_cast<double>(ranks.size()) / sum : 1.0;
  }
  [[nodiscard]] double max_exposed_comm_s() const noexcept {
    return report_detail::max_over(ranks, [](const RankTiming& r) { return r.exposed_comm_s; });
  }
  [[nodiscard]] std::uint64_t max_bytes_sent() const noexcept {
    return report_detail::max_over(ranks, [](const RankTiming& r) { return r.bytes_intra + r.bytes_inter; });
  }
};

/// Replays compiled per-rank programs (one per world rank) on a hardware profile: attention kernels by
/// FLOPs at the profile's efficiency for their tile length, point-to-point transfers and collectives by
/// alpha-beta on the link class they cross (NVLink inside a node's NVLink domain; the ranks' PCIe links
/// between domains of a node; a NIC shared by the node's ranks across nodes, and the rank's PCIe link on
/// the way when the profile models it: HardwareProfile::nvlink_domain, host) plus the call's fixed costs (one per
/// exchange or grouped post, one per peer: HardwareProfile::fixed_comm_seconds), copies through HBM plus a launch gap
/// each. Each rank runs its steps in order, as the executor does: a transfer starts when both sides have posted it and
/// overlaps whatever the ranks compute until the matching wait; a collective starts when its last member arrives. The
/// programs are lowered once; `run` replays them from any per-rank start times (the step simulator replays one layer
/// after another). Cost: O(total steps + transfers) per run; lowering is linear in the programs' pieces.
class Replay {
 public:
  /// Replays the programs as the executor runs them: each is lowered by runtime::lower (the executor's
  /// own lowering) for the options' element sizes, then priced op by op.
  Replay(std::span<const comm::Program> programs, const Topology& topology, const AttentionShape& shape,
         const SimulationOptions& options)
      : Replay(lowered(programs, options), topology, shape, options) {}

  /// Replays lowered programs (one per world rank, lowered for the options' element sizes): what an
  /// executor runs, op for op (attention calls, merges, fills, zero fills, local copies, exchanges,
  /// posts and waits).
  Replay(std::span<const runtime::LoweredProgram> programs, const Topology& topology, const AttentionShape& shape,
         const SimulationOptions& options)
      : topo_(topology), options_(options) {
    constexpr const char* where = "replay::Replay";
    topology.validate(where);
    shape.validate(where);
    options.hardware.validate(where);
    detail::require(static_cast<int>(programs.size()) == topology.world_size, where, "programs.size()", programs.size(),
                    "must equal topology.world_size = " + std::to_string(topology.world_size));
    if (options_.value_bytes == 0) options_.value_bytes = options.hardware.value_bytes;
    detail::require(options_.value_bytes > 0, where, "options.value_bytes", options_.value_bytes, "must be > 0");
    for (int r = 0; r < topology.world_size; ++r)
      detail::require(programs[static_cast<std::size_t>(r)].rank == r, where, "programs[r].rank",
                      programs[static_cast<std::size_t>(r)].rank, "must equal r = " + std::to_string(r));
    lower(programs, shape);
  }

  /// `programs` lowered as the executor lowers them, for the options' element sizes (kernel scratch
  /// is not priced: sized 0).
  [[nodiscard]] static std::vector<runtime::LoweredProgram> lowered(std::span<const comm::Program> programs,
                                                                    const SimulationOptions& options) {
    const int value_bytes = options.value_bytes != 0 ? options.value_bytes : options.hardware.value_bytes;
    detail::require(value_bytes > 0, "replay::Replay", "options.value_bytes", value_bytes, "must be > 0");
    detail::require(options.lse_bytes > 0, "replay::Replay", "options.lse_bytes", options.lse_bytes, "must be > 0");
    std::vector<runtime::LoweredProgram> out;
    out.reserve(programs.size());
    for (const comm::Program& p : programs)
      out.push_back(runtime::lower(p, static_cast<std::size_t>(value_bytes),
                                   static_cast<std::size_t>(options.lse_bytes),
                                   [](const AttentionShape&, std::int64_t, std::int64_t) { return std::uint64_t{0}; }));
    return out;
  }

  [[nodiscard]] int world_size() const noexcept { return topo_.world_size; }

  /// Replays from `start` (seconds, per rank; empty = all zero); record_trace = false leaves the trace
  /// empty even when the options ask for one.
  [[nodiscard]] SimulationReport run(std::span<const double> start = {}, bool record_trace = true) const {
    const int n = topo_.world_size;
    detail::require(start.empty() || static_cast<int>(start.size()) == n, "replay::Replay::run", "start.size()",
                    start.size(), "must be 0 or the world size " + std::to_string(n));
    constexpr double kUnposted = std::numeric_limits<double>::quiet_NaN();
    std::vector<double> send_post(messages_.size(), kUnposted), recv_post(messages_.size(), kUnposted);
    std::vector<int> arrived(instances_.size(), 0);
    std::vector<double> arrival(instances_.size(), 0.0);
    std::vector<std::size_t> pc(static_cast<std::size_t>(n), 0);
    std::vector<char> at_collective(static_cast<std::size_t>(n), 0);
    SimulationReport rep;
    rep.ranks.resize(static_cast<std::size_t>(n));
    rep.trace.topology = topo_;
    std::vector<double> t(static_cast<std::size_t>(n), 0.0);
    for (int r = 0; r < n; ++r) {
      auto& rt = rep.ranks[static_cast<std::size_t>(r)];
      t[static_cast<std::size_t>(r)] = rt.start_s = start.empty() ? 0.0 : start[static_cast<std::size_t>(r)];
      rt.bytes_intra = ranks_[static_cast<std::size_t>(r)].bytes_intra;
      rt.bytes_inter = ranks_[static_cast<std::size_t>(r)].bytes_inter;
      rt.staging_bytes = ranks_[static_cast<std::size_t>(r)].staging_bytes;
      rt.kernel_calls = ranks_[static_cast<std::size_t>(r)].kernel_calls;
      rt.slices = ranks_[static_cast<std::size_t>(r)].slices;
      rt.head_pairs = ranks_[static_cast<std::size_t>(r)].head_pairs;
      rt.merges = ranks_[static_cast<std::size_t>(r)].merges;
    }
    const auto traced = [&](int r) { return record_trace && options_.trace && r < options_.trace_max_ranks; };
    // Ranks to advance. A rank blocked on a transfer or a collective leaves the queue and is put back by
    // the post or the arrival it waits for, so a run costs O(ops + messages), not O(ranks) per step of
    // the slowest chain (a 1024-rank ring was 1023 sweeps of every rank). Times do not depend on the
    // order ranks are advanced in: a transfer ends at max(both posts) + its duration.
    std::vector<int> ready(static_cast<std::size_t>(n));
    for (int r = 0; r < n; ++r) ready[static_cast<std::size_t>(r)] = n - 1 - r;  // popped from the back: 0 first
    std::vector<char> queued(static_cast<std::size_t>(n), 1), done(static_cast<std::size_t>(n), 0);
    std::vector<std::vector<int>> waiting(instances_.size());
    const auto wake = [&](int r) {
      const auto ur = static_cast<std::size_t>(r);
      if (queued[ur] || done[ur]) return;
      queued[ur] = 1;
      ready.push_back(r);
    };

    // Advances rank r as far as it can go (until it blocks or ends).
    const auto advance = [&](int r) {
      const auto ur = static_cast<std::size_t>(r);
      const LoweredRank& lr = ranks_[ur];
      RankTiming& rt = rep.ranks[ur];
      double& now = t[ur];
      while (pc[ur] < lr.ops.size()) {
        const Op& op = lr.ops[pc[ur]];
        switch (op.kind) {
          case OpKind::kCompute:
          case OpKind::kCopy:
            if (traced(r) && op.seconds > 0)
              rep.trace.events.push_back(
                  {r, 0, op.kind == OpKind::kCompute ? op.label : "copy", now, op.seconds, op.amount});
            (op.kind == OpKind::kCompute ? rt.compute_s : rt.copy_s) += op.seconds;
            now += op.seconds;
            break;
          case OpKind::kPost:
            for (int i = op.begin; i < op.end; ++i) {
              const int m = lr.msgs[static_cast<std::size_t>(i)];
              const Message& msg = messages_[static_cast<std::size_t>(m)];
              (msg.src == r ? send_post : recv_post)[static_cast<std::size_t>(m)] = now;
              wake(msg.src == r ? msg.dst : msg.src);  // the peer may be waiting on it
            }
            break;
          case OpKind::kWait: {
            double done = now;
            for (int i = op.begin; i < op.end; ++i) {
              const auto m = static_cast<std::size_t>(lr.msgs[static_cast<std::size_t>(i)]);
              if (std::isnan(send_post[m]) || std::isnan(recv_post[m])) return;  // peer has not posted yet
              done = std::max(done, std::max(send_post[m], recv_post[m]) + messages_[m].duration);
            }
            for (int i = op.begin; i < op.end; ++i) {
              const auto m = static_cast<std::size_t>(lr.msgs[static_cast<std::size_t>(i)]);
              const Message& msg = messages_[m];
              rt.comm_s += msg.duration;
              if (traced(r) && msg.src == r)
                rep.trace.events.push_back({r, 1, msg.inter ? "send (inter-node)" : "send",
                                            std::max(send_post[m], recv_post[m]), msg.duration,
                                            static_cast<double>(msg.bytes), msg.dst});
            }
            if (traced(r) && done > now) rep.trace.events.push_back({r, 0, "wait", now, done - now, 0});
            rt.exposed_comm_s += done - now;
            now = done;
            break;
          }
          case OpKind::kCollective: {
            const auto c = static_cast<std::size_t>(op.begin);
            if (!at_collective[ur]) {
              at_collective[ur] = 1;
              arrival[c] = arrived[c] == 0 ? now : std::max(arrival[c], now);
              ++arrived[c];
              if (arrived[c] < instances_[c].members) {
                waiting[c].push_back(r);
              } else {
                for (int w : waiting[c]) wake(w);
                std::vector<int>().swap(waiting[c]);
              }
            }
            if (arrived[c] < instances_[c].members) return;
            at_collective[ur] = 0;
            const double end = arrival[c] + instances_[c].duration;
            rt.comm_s += instances_[c].duration;
            if (traced(r)) {
              rep.trace.events.push_back({r, 1, "all_to_all", arrival[c], instances_[c].duration, op.amount});
              if (end > now) rep.trace.events.push_back({r, 0, "wait", now, end - now, 0});
            }
            rt.exposed_comm_s += end - now;
            now = end;
            break;
          }
        }
        ++pc[ur];
      }
    };

    int finished = 0;
    while (!ready.empty()) {
      const int r = ready.back();
      ready.pop_back();
      const auto ur = static_cast<std::size_t>(r);
      queued[ur] = 0;
      advance(r);
      if (pc[ur] == ranks_[ur].ops.size()) {
        done[ur] = 1;
        ++finished;
      }
    }
    if (finished < n) {
      int stuck = 0;
      while (done[static_cast<std::size_t>(stuck)]) ++stuck;
      throw std::logic_error("replay::Replay: the programs deadlock (rank " + std::to_string(stuck) +
                             " blocked at op " + std::to_string(pc[static_cast<std::size_t>(stuck)]) +
                             "): their transfers or collectives do not match");
    }
    double first = std::numeric_limits<double>::infinity(), last = 0;
    for (int r = 0; r < n; ++r) {
      auto& rt = rep.ranks[static_cast<std::size_t>(r)];
      rt.end_s = t[static_cast<std::size_t>(r)];
      first = std::min(first, rt.start_s);
      last = std::max(last, rt.end_s);
    }
    rep.time_s = last - first;
    return rep;
  }

 private:
  enum class OpKind : std::uint8_t { kCompute, kCopy, kPost, kWait, kCollective };
  struct Op {
    OpKind kind{};
    double seconds = 0;      // compute, copy
    int begin = 0, end = 0;  // post/wait: range of LoweredRank::msgs; collective: begin = instance
    const char* label = "";
    double amount = 0;  // trace argument: FLOPs or bytes
  };
  struct LoweredRank {
    std::vector<Op> ops;
    std::vector<int> msgs;
    std::uint64_t bytes_intra = 0, bytes_inter = 0;
    double staging_bytes = 0;
    std::int64_t kernel_calls = 0, slices = 0, head_pairs = 0, merges = 0;
  };

  [[nodiscard]] static const comm::BufferSpec* find_staging(const runtime::LoweredProgram& p, comm::BufferId b) {
    for (const comm::BufferSpec& s : p.staging)
      if (s.id == b) return &s;
    return nullptr;
  }
  struct Message {
    int src = 0, dst = 0;
    std::uint64_t bytes = 0;
    bool inter = false;
    bool host = false;  // same node, other NVLink domain: over the ranks' PCIe links
    double duration = 0;
  };
  struct Instance {
    int members = 0;
    double duration = 0;
  };

  [[nodiscard]] int nic_of(int rank) const noexcept {
    const int local = rank % topo_.ranks_per_node;
    return topo_.node_of(rank) * options_.hardware.nics_per_node + local % options_.hardware.nics_per_node;
  }
  /// Same node, different NVLink domains (HardwareProfile::nvlink_domain): the transfer crosses PCIe.
  [[nodiscard]] bool crosses_domains(int a, int b) const noexcept {
    return topo_.same_node(a, b) && !options_.hardware.same_domain(a % topo_.ranks_per_node, b % topo_.ranks_per_node);
  }
  [[nodiscard]] double compute_share() const noexcept {
    const HardwareProfile& hw = options_.hardware;
    const int on_node = std::min(topo_.ranks_per_node, topo_.world_size);
    return hw.cores_per_node > 0 ? std::max(1.0, static_cast<double>(on_node) / hw.cores_per_node) : 1.0;
  }

  void lower(std::span<const runtime::LoweredProgram> programs, const AttentionShape& shape) {
    const HardwareProfile& hw = options_.hardware;
    const int n = topo_.world_size;
    const double vb = options_.value_bytes, lb = options_.lse_bytes;
    const double share = compute_share();
    ranks_.resize(static_cast<std::size_t>(n));

    // Messages: the k-th send from a to b with (level, tag) meets the k-th receive at b from a with them.
    struct PendingRecv {
      int rank;
      std::size_t slot_in_msgs;
      std::uint64_t key;
      int ordinal;
    };
    std::unordered_map<std::uint64_t, std::vector<int>> sends_by_key;
    std::vector<PendingRecv> recvs;
    const auto key_of = [n](int src, int dst, comm::Level level, int tag) {
      return ((static_cast<std::uint64_t>(src) * static_cast<std::uint64_t>(n) + static_cast<std::uint64_t>(dst)) *
                  comm::kNumLevels +
              static_cast<std::uint64_t>(level)) *
                 (std::uint64_t{1} << 24) +
             static_cast<std::uint64_t>(tag);
    };
    std::unordered_map<std::uint64_t, int> recv_ordinal;
    // Bytes through each NIC per (level, tag), for sharing: ring steps with the same tag run together.
    std::unordered_map<std::uint64_t, double> nic_out, nic_in;
    const auto nic_key = [](int nic, comm::Level level, int tag) {
      return (static_cast<std::uint64_t>(nic) * comm::kNumLevels + static_cast<std::uint64_t>(level)) *
                 (std::uint64_t{1} << 24) +
             static_cast<std::uint64_t>(tag);
    };
    struct PostInfo {
      comm::Level level;
      int tag;
      double intra_out;  // the sender's NVLink bytes in this post: its flows share its link
      double host_out;   // the sender's bytes over its PCIe link in this post (HardwareProfile::host)
      double fixed;      // the post's call and per-peer cost (HardwareProfile::fixed_comm_seconds)
    };
    std::vector<PostInfo> message_post;

    // Collectives: the k-th exchange of a rank on a level group meets the k-th of every member.
    std::unordered_map<std::string, std::vector<int>> group_instances;
    struct InstanceBytes {
      std::unordered_map<int, double> intra_out, intra_in, host_out, host_in, nic_out, nic_in;
      bool crosses_domains = false;
      bool spans_nodes = false;
      double bytes = 0;
      double fixed = 0;  // the largest per-call + per-peer cost of a member (HardwareProfile::fixed_comm_seconds)
    };
    std::vector<InstanceBytes> inst_bytes;

    for (int r = 0; r < n; ++r) {
      const runtime::LoweredProgram& p = programs[static_cast<std::size_t>(r)];
      LoweredRank& lr = ranks_[static_cast<std::size_t>(r)];
      const int d = p.head_dim, dv = p.widths().v;
      const comm::HeadWidths widths = p.widths();
      for (const comm::BufferSpec& s : p.staging)
        lr.staging_bytes += static_cast<double>(s.rows) * s.heads * (comm::is_lse(s.id) ? lb : vb * widths.of(s.id));
      const auto world_of = [&](comm::Level l, int peer) {
        const auto& members = p.level_members[static_cast<std::size_t>(l)];
        detail::require(peer >= 0 && static_cast<std::size_t>(peer) < members.size(), "replay::Replay", "peer", peer,
                        "is not a member of the level of rank " + std::to_string(r));
        return members[static_cast<std::size_t>(peer)];
      };
      // Bytes of a buffer's rows on this rank (zero fills): the caller's tensors have the program's
      // local rows with Hq (q, o, dq, dout) or Hkv heads, the carry its own rows, staging its spec.
      const auto buffer_bytes = [&](comm::BufferId b) {
        using comm::BufferId;
        if (const comm::BufferSpec* s = find_staging(p, b))
          return static_cast<double>(s->rows) * s->heads * (comm::is_lse(b) ? lb : vb * widths.of(b));
        if (comm::is_carry_buffer(b)) return static_cast<double>(p.carry_rows) * shape.heads_kv * vb * widths.of(b);
        const bool kv = b == BufferId::kK || b == BufferId::kV || b == BufferId::kDk || b == BufferId::kDv;
        if (b == BufferId::kLse) return static_cast<double>(p.local_tokens) * shape.heads_q * lb;
        return static_cast<double>(p.local_tokens) * (kv ? shape.heads_kv : shape.heads_q) * vb * widths.of(b);
      };
      std::array<std::pair<int, int>, comm::kNumSlots> slot_msgs{};  // msgs range of the slot's last post
      std::array<double, comm::kNumSlots> slot_unpack{};             // bytes it receives (unpacked at the wait)
      std::unordered_map<std::string, int> group_seen;
      for (const runtime::LoweredOp& lop : p.ops) {
        std::visit(
            Overloaded{
                [&](const runtime::AttentionOp& a) {
                  const auto slices = p.view(p.slices, a.slices);
                  const int heads = static_cast<int>(a.heads.q_heads.size());
                  const double pairs = static_cast<double>(total_area(slices)) * heads;
                  lr.ops.push_back({OpKind::kCompute, attention_seconds(hw, slices, heads, d, a.backward, dv) * share,
                                    0, 0, a.backward ? "attention bwd" : "attention fwd",
                                    attention_flops(pairs, d, a.backward, dv)});
                  lr.kernel_calls += 1;
                  lr.slices += static_cast<std::int64_t>(slices.size());
                  lr.head_pairs += static_cast<std::int64_t>(total_area(slices)) * heads;
                },
                [&](const runtime::MergeOp& m) {
                  double merged = 0;
                  for (const AttnSlice& s : p.view(p.slices, m.slices))
                    merged += static_cast<double>(s.q_range.size()) * static_cast<double>(m.heads.q_heads.size()) *
                              (dv * vb + lb);
                  // Reads the partial and the result, writes the result.
                  lr.ops.push_back({OpKind::kCopy, copy_seconds(hw, 1.5 * merged), 0, 0, "merge", merged});
                  lr.merges += 1;
                },
                [&](const runtime::FillEmptyOp& f) {
                  const double bytes = static_cast<double>(p.local_tokens) *
                                       static_cast<double>(f.heads.q_heads.size()) * (dv * vb + lb);
                  lr.ops.push_back({OpKind::kCopy, fill_seconds(hw, bytes), 0, 0, "fill", bytes});
                },
                [&](const runtime::ZeroOp& z) {
                  double bytes = 0;
                  for (comm::BufferId b : p.view(p.buffers, z.buffers)) bytes += buffer_bytes(b);
                  lr.ops.push_back({OpKind::kCopy, fill_seconds(hw, bytes), 0, 0, lop.kind, bytes});
                },
                [&](const runtime::CopyOp& c) {
                  const auto bytes = static_cast<double>(c.bytes);  // packed into the send region, unpacked from it
                  if (bytes > 0) lr.ops.push_back({OpKind::kCopy, copy_seconds(hw, 2 * bytes), 0, 0, "copy", bytes});
                },
                [&](const runtime::PostOp& post) {
                  const int begin = static_cast<int>(lr.msgs.size());
                  double packed = 0, intra_out = 0, host_out = 0;
                  int intra_peers = 0, inter_peers = 0;
                  for (const runtime::TransferEntry& tr : p.view(p.transfers, post.sends)) {
                    const int dst = world_of(post.level, tr.peer);
                    const auto bytes = static_cast<double>(tr.bytes);
                    packed += bytes;
                    const bool inter = !topo_.same_node(r, dst);
                    const bool cross = crosses_domains(r, dst);
                    (inter ? lr.bytes_inter : lr.bytes_intra) += tr.bytes;
                    if (inter) {
                      nic_out[nic_key(nic_of(r), post.level, post.tag)] += bytes;
                      nic_in[nic_key(nic_of(dst), post.level, post.tag)] += bytes;
                      if (hw.has_host_link()) host_out += bytes;
                    } else if (cross) {
                      host_out += bytes;
                    } else {
                      intra_out += bytes;
                    }
                    const int id = static_cast<int>(messages_.size());
                    messages_.push_back({r, dst, tr.bytes, inter, cross, 0.0});
                    ++(inter ? inter_peers : intra_peers);
                    message_post.push_back({post.level, post.tag, 0.0, 0.0, 0.0});
                    sends_by_key[key_of(r, dst, post.level, post.tag)].push_back(id);
                    lr.msgs.push_back(id);
                  }
                  // A grouped post pays one call and a handshake per peer, as an all-to-all does; its messages
                  // fly together, so each carries the post's whole fixed cost.
                  const double fixed = hw.fixed_comm_seconds(intra_peers, inter_peers);
                  for (std::size_t i = static_cast<std::size_t>(begin); i < lr.msgs.size(); ++i) {
                    message_post[static_cast<std::size_t>(lr.msgs[i])].intra_out = intra_out;
                    message_post[static_cast<std::size_t>(lr.msgs[i])].host_out = host_out;
                    message_post[static_cast<std::size_t>(lr.msgs[i])].fixed = fixed;
                  }
                  double unpacked = 0;
                  for (const runtime::TransferEntry& tr : p.view(p.transfers, post.recvs)) {
                    const int src = world_of(post.level, tr.peer);
                    unpacked += static_cast<double>(tr.bytes);
                    const std::uint64_t key = key_of(src, r, post.level, post.tag);
                    recvs.push_back({r, lr.msgs.size(), key, recv_ordinal[key]++});
                    lr.msgs.push_back(-1);  // resolved below
                  }
                  if (packed > 0) lr.ops.push_back({OpKind::kCopy, copy_seconds(hw, packed), 0, 0, "pack", packed});
                  lr.ops.push_back({OpKind::kPost, 0, begin, static_cast<int>(lr.msgs.size()), lop.kind, packed});
                  slot_msgs[static_cast<std::size_t>(post.slot)] = {begin, static_cast<int>(lr.msgs.size())};
                  slot_unpack[static_cast<std::size_t>(post.slot)] = unpacked;
                },
                [&](const runtime::WaitOp& w) {
                  const auto [b, e] = slot_msgs[static_cast<std::size_t>(w.slot)];
                  lr.ops.push_back({OpKind::kWait, 0, b, e, lop.kind, 0});
                  const double unpacked = slot_unpack[static_cast<std::size_t>(w.slot)];
                  if (unpacked > 0)
                    lr.ops.push_back({OpKind::kCopy, copy_seconds(hw, unpacked), 0, 0, "unpack", unpacked});
                },
                [&](const runtime::ExchangeOp& ex) {
                  const auto& members = p.level_members[static_cast<std::size_t>(ex.level)];
                  std::string gkey = std::to_string(static_cast<int>(ex.level)) + ':';
                  for (int m : members) gkey += std::to_string(m) + ',';
                  const int ordinal = group_seen[gkey]++;
                  auto& list = group_instances[gkey];
                  if (static_cast<int>(list.size()) <= ordinal) {
                    list.push_back(static_cast<int>(instances_.size()));
                    instances_.push_back({static_cast<int>(members.size()), 0.0});
                    inst_bytes.emplace_back();
                  }
                  const int inst = list[static_cast<std::size_t>(ordinal)];
                  InstanceBytes& ib = inst_bytes[static_cast<std::size_t>(inst)];
                  const auto self =
                      static_cast<std::size_t>(std::find(members.begin(), members.end(), r) - members.begin());
                  const auto send_counts = p.view(p.counts, ex.send_counts);
                  const auto recv_counts = p.view(p.counts, ex.recv_counts);
                  double sent = 0;
                  int intra_peers = 0, inter_peers = 0;
                  for (std::size_t peer = 0; peer < send_counts.size(); ++peer) {
                    const auto bytes = static_cast<double>(send_counts[peer]);
                    const bool talks =
                        peer != self && (send_counts[peer] > 0 || (peer < recv_counts.size() && recv_counts[peer] > 0));
                    if (talks) ++(topo_.same_node(r, members[peer]) ? intra_peers : inter_peers);
                    if (peer == self || bytes == 0) continue;
                    const int dst = world_of(ex.level, static_cast<int>(peer));
                    sent += bytes;
                    if (!topo_.same_node(r, dst)) {
                      ib.spans_nodes = true;
                      ib.nic_out[nic_of(r)] += bytes;
                      ib.nic_in[nic_of(dst)] += bytes;
                      if (hw.has_host_link()) {
                        ib.host_out[r] += bytes;
                        ib.host_in[dst] += bytes;
                      }
                      lr.bytes_inter += send_counts[peer];
                    } else if (crosses_domains(r, dst)) {
                      ib.crosses_domains = true;
                      ib.host_out[r] += bytes;
                      ib.host_in[dst] += bytes;
                      lr.bytes_intra += send_counts[peer];
                    } else {
                      ib.intra_out[r] += bytes;
                      ib.intra_in[dst] += bytes;
                      lr.bytes_intra += send_counts[peer];
                    }
                  }
                  ib.fixed = std::max(ib.fixed, hw.fixed_comm_seconds(intra_peers, inter_peers));
                  ib.bytes += sent;
                  // The executor packs every piece (its own rank's too) and unpacks every piece it receives.
                  const auto packed = static_cast<double>(ex.send_bytes), unpacked = static_cast<double>(ex.recv_bytes);
                  if (packed > 0) lr.ops.push_back({OpKind::kCopy, copy_seconds(hw, packed), 0, 0, "pack", packed});
                  lr.ops.push_back({OpKind::kCollective, 0, inst, 0, "all_to_all", sent});
                  if (unpacked > 0)
                    lr.ops.push_back({OpKind::kCopy, copy_seconds(hw, unpacked), 0, 0, "unpack", unpacked});
                }},
            lop.op);
      }
    }

    // Pair receives with sends, then price every message on its link (flows of one post share the
    // sender's NVLink; inter-node flows of one ring step share their NICs).
    for (const PendingRecv& pr : recvs) {
      auto it = sends_by_key.find(pr.key);
      if (it == sends_by_key.end() || static_cast<int>(it->second.size()) <= pr.ordinal)
        throw std::logic_error("replay::Replay: rank " + std::to_string(pr.rank) +
                               " receives a message no rank sends: the programs do not match");
      ranks_[static_cast<std::size_t>(pr.rank)].msgs[pr.slot_in_msgs] =
          it->second[static_cast<std::size_t>(pr.ordinal)];
    }
    for (const auto& [key, ids] : sends_by_key)
      if (static_cast<int>(ids.size()) != recv_ordinal[key])
        throw std::logic_error("replay::Replay: a message is sent and never received: the programs do not match");
    for (std::size_t m = 0; m < messages_.size(); ++m) {
      Message& msg = messages_[m];
      const PostInfo& info = message_post[m];
      const double bytes = static_cast<double>(msg.bytes);
      if (msg.inter) {
        const double through = std::max(nic_out[nic_key(nic_of(msg.src), info.level, info.tag)],
                                        nic_in[nic_key(nic_of(msg.dst), info.level, info.tag)]);
        double wire = std::max(bytes, through) / hw.inter.bandwidth;
        if (hw.has_host_link()) wire = std::max(wire, std::max(bytes, info.host_out) / hw.host.bandwidth);
        msg.duration = hw.inter.latency + info.fixed + wire;
      } else if (msg.host) {
        msg.duration = hw.host.latency + info.fixed + std::max(bytes, info.host_out) / hw.host.bandwidth;
      } else {
        msg.duration = hw.intra.latency + info.fixed +
                       std::max(static_cast<double>(msg.bytes), info.intra_out) / hw.intra.bandwidth;
      }
    }
    for (std::size_t i = 0; i < instances_.size(); ++i) {
      const InstanceBytes& ib = inst_bytes[i];
      double worst = 0;
      for (const auto& [k, b] : ib.intra_out) worst = std::max(worst, b / hw.intra.bandwidth);
      for (const auto& [k, b] : ib.intra_in) worst = std::max(worst, b / hw.intra.bandwidth);
      for (const auto& [k, b] : ib.nic_out) worst = std::max(worst, b / hw.inter.bandwidth);
      for (const auto& [k, b] : ib.nic_in) worst = std::max(worst, b / hw.inter.bandwidth);
      for (const auto& [k, b] : ib.host_out) worst = std::max(worst, b / hw.host.bandwidth);
      for (const auto& [k, b] : ib.host_in) worst = std::max(worst, b / hw.host.bandwidth);
      const double alpha = ib.spans_nodes       ? hw.inter.latency
                           : ib.crosses_domains ? std::max(hw.intra.latency, hw.host.latency)
                                                : hw.intra.latency;
      instances_[i].duration = ib.bytes > 0 ? alpha + ib.fixed + worst : 0.0;
    }
  }

  Topology topo_;
  SimulationOptions options_;
  std::vector<LoweredRank> ranks_;
  std::vector<Message> messages_;
  std::vector<Instance> instances_;
};

/// Replays `programs` (one per world rank) from time 0.
[[nodiscard]] inline SimulationReport simulate(std::span<const comm::Program> programs, const Topology& topology,
                                               const AttentionShape& shape, const SimulationOptions& options) {
  return Replay(programs, topology, shape, options).run();
}

}  // namespace seqpar::replay
