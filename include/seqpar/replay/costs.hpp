// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>

#include "seqpar/core/attn_slice.hpp"
#include "seqpar/core/topology.hpp"
#include "seqpar/replay/hardware.hpp"

namespace seqpar::replay {

/// FLOPs of attention over `head_pairs` (query, key) pairs summed over query heads: 2 * d_qk (QK^T) +
/// 2 * d_v (PV) per pair forward, 4 * d with one head size, 2.5x that backward (FlashAttention-2's convention,
/// which recomputes P). head_dim_v = 0: the same as head_dim.
[[nodiscard]] constexpr double attention_flops(double head_pairs, int head_dim, bool backward,
                                               int head_dim_v = 0) noexcept {
  return 2.0 * (head_dim + (head_dim_v != 0 ? head_dim_v : head_dim)) * head_pairs * (backward ? 2.5 : 1.0);
}

/// (query, key) slots the kernel computes for `s`: whole tile x tile blocks touched by visible pairs, plus
/// `overhead` blocks per query block that sees any key (HardwareProfile::attention_tile). tile = 1 and
/// overhead = 0 give exactly s.area().
[[nodiscard]] inline double attention_slots(const AttnSlice& s, double tile, double overhead) noexcept {
  const std::int64_t q = s.q_range.size(), k = s.k_range.size();
  if (q <= 0 || k <= 0) return 0.0;
  const auto t = static_cast<std::int64_t>(tile);
  if (t <= 1) {
    if (overhead == 0.0) return static_cast<double>(s.area());
    // Rows that see at least one key: hi > lo in Mask::visible_keys.
    const std::int64_t off = s.mask.causal_offset;
    std::int64_t rows = q;
    if (s.mask.kind != MaskKind::kFull) {
      const std::int64_t first = std::clamp<std::int64_t>(-off, 0, q);
      const std::int64_t last =
          s.mask.kind == MaskKind::kSlidingWindow
              ? std::clamp<std::int64_t>(seqpar::detail::add_sat(k - off - 1, s.mask.window), 0, q)
              : q;
      rows = std::max<std::int64_t>(0, last - first);
    }
    return static_cast<double>(s.area()) + overhead * static_cast<double>(rows);
  }
  const std::int64_t q_blocks = (q + t - 1) / t;
  if (s.mask.kind == MaskKind::kFull)
    return static_cast<double>(q_blocks) * (static_cast<double>((k + t - 1) / t) + overhead) * tile * tile;
  double blocks = 0;
  for (std::int64_t b = 0; b < q_blocks; ++b) {
    const std::int64_t r0 = b * t, r1 = std::min(q, r0 + t) - 1;
    const std::int64_t hi = s.mask.visible_keys(r1, k).end;
    const std::int64_t lo = s.mask.visible_keys(r0, k).begin;
    if (hi <= lo) continue;  // the whole block is masked: kernels skip it
    blocks += static_cast<double>((hi + t - 1) / t - lo / t) + overhead;
  }
  return blocks * tile * tile;
}

/// Seconds of one attention kernel call over `slices` for `heads` query heads, on one rank of `hw`:
/// FLOPs of the tile slots the kernel computes (attention_slots) at the profile's rate.
[[nodiscard]] inline double attention_seconds(const HardwareProfile& hw, std::span<const AttnSlice> slices, int heads,
                                              int head_dim, bool backward, int head_dim_v = 0) noexcept {
  double s = 0.0;
  for (const AttnSlice& slice : slices) {
    const double slots = attention_slots(slice, hw.attention_tile, hw.attention_tile_overhead);
    if (slots > 0)
      s += attention_flops(slots * heads, head_dim, backward, head_dim_v) /
           hw.attention_rate(static_cast<double>(slice.q_range.size()), backward);
  }
  return s + hw.kernel_launch;
}

/// Roofline time of a GEMM-like operation: bound by compute or by moving `bytes` through HBM.
[[nodiscard]] inline double gemm_seconds(const HardwareProfile& hw, double flops, double bytes) noexcept {
  return std::max(flops / hw.gemm_rate(), bytes / hw.hbm_bandwidth);
}

/// A local copy of `bytes` (pack / unpack): read and write through HBM, plus the copy kernel's launch gap.
[[nodiscard]] inline double copy_seconds(const HardwareProfile& hw, double bytes) noexcept {
  return bytes > 0 ? 2.0 * bytes / hw.hbm_bandwidth + hw.copy_launch : 0.0;
}

/// A zero fill of `bytes`: written once through HBM, plus the kernel's launch gap.
[[nodiscard]] inline double fill_seconds(const HardwareProfile& hw, double bytes) noexcept {
  return bytes > 0 ? bytes / hw.hbm_bandwidth + hw.copy_launch : 0.0;
}

/// Whether a group of `ranks` consecutive ranks of `topo` (starting at a node boundary) has members in more
/// than one NVLink domain of a node (HardwareProfile::nvlink_domain): its traffic then crosses PCIe.
[[nodiscard]] inline bool spans_domains(const HardwareProfile& hw, const Topology& topo, int ranks) noexcept {
  const int local = std::min(ranks, topo.ranks_per_node);
  return local > hw.domain_ranks(topo.ranks_per_node);
}

/// Bus bandwidth of a ring collective (all-gather, reduce-scatter) over `ranks` ranks of `topo`: NVLink
/// inside one node; across nodes every ring crosses each node boundary once per NIC, so the node's NICs
/// together bound it (nccl-tests: multi-node ring busbw ~ the node's NIC total, anchors-hw.md 1.3). A ring
/// that crosses PCIe (between NVLink domains, or to a NIC when the profile models the host link) runs at
/// most at the PCIe link's rate (nccl-tests#178: 208 GB/s on an NVLink-bridged A100 pair, 20 GB/s once
/// the ring crosses PCIe).
[[nodiscard]] inline double ring_busbw(const HardwareProfile& hw, const Topology& topo, int ranks) noexcept {
  const bool spans_nodes = ranks > topo.ranks_per_node;
  double bw = spans_nodes ? std::min(hw.intra.bandwidth, hw.nics_per_node * hw.inter.bandwidth) : hw.intra.bandwidth;
  if (spans_domains(hw, topo, ranks) || (spans_nodes && hw.has_host_link())) bw = std::min(bw, hw.host.bandwidth);
  return bw;
}

/// All-gather (or reduce-scatter) where every rank ends with (or starts from) `total_bytes` spread over
/// `ranks`: the call's fixed cost (HardwareProfile::collective_latency) + base latency + (n-1) ring steps of
/// hardware latency + (n-1)/n * total / busbw. Step latencies 0.6 us over NVLink, 1.0 us over PCIe and
/// 2.7 us over the network are NCCL's tuning constants (src/graph/tuning.cc hwLat, Ring LL; anchors-hw.md 1.4).
[[nodiscard]] inline double ring_collective_seconds(const HardwareProfile& hw, const Topology& topo, int ranks,
                                                    double total_bytes) noexcept {
  if (ranks <= 1 || total_bytes <= 0) return 0.0;
  const bool spans_nodes = ranks > topo.ranks_per_node;
  const bool pcie = spans_domains(hw, topo, ranks);
  const double alpha = spans_nodes ? hw.inter.latency
                       : pcie      ? std::max(hw.intra.latency, hw.host.latency)
                                   : hw.intra.latency;
  return hw.collective_latency + alpha +
         (ranks - 1) * (spans_nodes ? 2.7e-6
                        : pcie      ? 1.0e-6
                                    : 0.6e-6) +
         (ranks - 1.0) / ranks * total_bytes / ring_busbw(hw, topo, ranks);
}

/// A balanced all-to-all over `ranks` consecutive ranks of `topo` (the group starts at a node boundary):
/// every rank holds `bytes_per_rank` and sends 1/ranks of it to each peer (Ulysses' sequence <-> head
/// exchange). Priced as the replay prices an exchange step: one latency, the call's fixed cost (per call
/// and per peer, HardwareProfile::fixed_comm_seconds), the busiest link's bytes over its bandwidth (a
/// rank's NVLink to the peers of its NVLink domain; its PCIe link to the other domains of its node, and to
/// its NIC when the profile models that link; across nodes, a NIC carries the traffic of the ranks that
/// share it), and packing and unpacking through HBM. The exchange ends with its slowest rank: NVLink is
/// busiest in the largest domain the group has on a node, PCIe in the smallest.
[[nodiscard]] inline double all_to_all_seconds(const HardwareProfile& hw, const Topology& topo, int ranks,
                                               double bytes_per_rank) noexcept {
  if (ranks <= 1 || bytes_per_rank <= 0) return 0.0;
  const int local = std::min(ranks, topo.ranks_per_node);                    // group members on one node
  const int domain = std::min(local, hw.domain_ranks(topo.ranks_per_node));  // the most on one NVLink domain
  const int smallest = local % domain == 0 ? domain : local % domain;        // the fewest
  const double to_each = bytes_per_rank / ranks;
  const double intra = to_each * (domain - 1) / hw.intra.bandwidth;
  const bool spans_nodes = ranks > topo.ranks_per_node;
  const double ranks_per_nic = std::max(1.0, static_cast<double>(local) / hw.nics_per_node);
  const double inter = spans_nodes ? to_each * (ranks - local) * ranks_per_nic / hw.inter.bandwidth : 0.0;
  const double over_pcie = to_each * ((local - smallest) + (hw.has_host_link() ? ranks - local : 0));
  const double host = over_pcie > 0 ? over_pcie / hw.host.bandwidth : 0.0;
  const double alpha = spans_nodes      ? hw.inter.latency
                       : local > domain ? std::max(hw.intra.latency, hw.host.latency)
                                        : hw.intra.latency;
  return alpha + hw.fixed_comm_seconds(local - 1, ranks - local) + std::max({intra, inter, host}) +
         2.0 * copy_seconds(hw, bytes_per_rank);
}

}  // namespace seqpar::replay
