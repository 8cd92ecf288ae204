// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

#include <algorithm>
#include <cctype>
#include <cmath>
#include <string>
#include <string_view>
#include <vector>

#include "seqpar/core/error.hpp"

namespace seqpar::replay {

/// One class of link in the alpha-beta model: a message of n bytes takes latency + n / bandwidth.
struct LinkClass {
  double bandwidth = 0.0;  ///< bytes/s, one direction, what NCCL (or the transport) achieves
  double latency = 0.0;    ///< s per message (alpha)

  [[nodiscard]] double time(double bytes) const noexcept { return bytes > 0 ? latency + bytes / bandwidth : 0.0; }
};

/// What the cost model knows of one accelerator (or CPU rank) and its node. Bandwidths are achievable
/// figures (nccl-tests busbw, measured copies), peaks are datasheet dense figures scaled by efficiencies.
struct HardwareProfile {
  std::string name;
  double peak_flops = 0.0;            ///< dense bf16 (CPU: fp32) FLOP/s of one rank
  double gemm_efficiency = 0.5;       ///< achieved fraction of peak on large GEMMs (MFU-like)
  double attention_efficiency = 0.6;  ///< achieved fraction of peak on long attention tiles
  /// Short documents are slower per useful FLOP. Two effects, both in attention_seconds (costs.hpp):
  ///  - tiling: the kernel computes whole attention_tile x attention_tile blocks (FA2/FA3: 128) and pays
  ///    attention_tile_overhead extra key blocks per query block (load Q, rescale and write O); a slice is
  ///    priced by the blocks it touches, so causal diagonals and chunks shorter than a tile waste work.
  ///    Fitted to FA3 on H100 (anchors-hw.md 2): 512-token causal documents run at ~0.47x the rate of a
  ///    16K causal sequence, which 128-blocks give with an overhead of ~1.9 blocks per query block.
  ///  - a per-length factor L / (L + attention_half_length), L = the slice's query rows, for kernels
  ///    measured rather than modelled (the CPU profile's fit); 0 for the GPU profiles.
  double attention_tile = 1;
  double attention_tile_overhead = 0;
  double attention_half_length = 0;
  /// Backward kernels reach this fraction of the forward's FLOP rate (FlashAttention counts 2.5x the
  /// forward FLOPs for backward; FA3 on H100 runs backward at ~0.9x the forward rate, anchors-hw.md 2).
  double attention_backward_factor = 0.9;
  double kernel_launch = 5e-6;  ///< s added per attention kernel call
  /// Fixed costs (issue 16): what a real NCCL call pays besides alpha + bytes / bandwidth. Without them the
  /// model credits every saved byte in full and overrates communication savings (BASP's all-to-all came out
  /// ~12x faster than Ulysses where the paper measured 2.45-3.10x). All 0 by default: a profile measured by
  /// bench/calibrate holds them in its fitted latency already.
  ///  - collective_latency: s per collective call or grouped point-to-point post (one ncclGroupStart/End):
  ///    the kernel launch, the proxy's setup and the members' synchronization, before any byte moves;
  ///  - peer_latency_intra / peer_latency_inter: s per peer a rank exchanges with in an all-to-all or a
  ///    grouped post (NCCL runs an all-to-all as one send/recv pair per peer, each with its own handshake);
  ///  - copy_launch: s per local copy kernel (pack, unpack, merge, zero fill): the launch gap between
  ///    kernels on a stream, which the HBM roofline of copy_seconds leaves out.
  double collective_latency = 0;
  double peer_latency_intra = 0;
  double peer_latency_inter = 0;
  double copy_launch = 0;
  double hbm_bandwidth = 0.0;  ///< bytes/s, roofline memory bound
  LinkClass intra;             ///< rank to rank inside a node (NVLink / shared memory), per rank
  LinkClass inter;             ///< one NIC across nodes
  int ranks_per_node = 8;      ///< GPUs per node
  int nics_per_node = 8;       ///< inter-node bandwidth of a node = nics_per_node * inter.bandwidth
  /// Which of a node's ranks share NVLink (issue 16: the BASP paper says "NVLink" for a 4-GPU A100-40GB
  /// node, not which layout). 0: every pair of a node's ranks, over `intra` (NVSwitch, or a full NVLink
  /// mesh as on HGX A100 4-GPU). k > 0: domains of k consecutive local ranks (local rank / k), as PCIe
  /// cards in NVLink-bridged pairs (k = 2); traffic between two domains of a node crosses `host`.
  int nvlink_domain = 0;
  /// A rank's own PCIe link to its host; bandwidth 0 = never the bottleneck (not modelled). When set it
  /// carries, in each direction, the rank's traffic to other NVLink domains of its node and its
  /// inter-node traffic (GPUDirect RDMA reaches the NIC over the GPU's PCIe link).
  LinkClass host;
  double memory_bytes = 0.0;  ///< per rank
  int value_bytes = 2;        ///< bytes of one activation element (bf16 = 2, CPU fp32 = 4)
  /// Processors a node's ranks share (CPU ranks as threads or processes on few cores); 0 = each rank has
  /// its own device. With more ranks on a node than cores, compute is time-shared: each rank's kernels
  /// take ranks_on_node / cores_per_node times longer.
  int cores_per_node = 0;

  /// FLOP rate on computed tile slots of a slice with `query_rows` rows (see attention_tile).
  [[nodiscard]] double attention_rate(double query_rows, bool backward) const noexcept {
    const double l = std::max(1.0, query_rows);
    return peak_flops * attention_efficiency * (backward ? attention_backward_factor : 1.0) * l /
           (l + attention_half_length);
  }
  [[nodiscard]] double gemm_rate() const noexcept { return peak_flops * gemm_efficiency; }
  /// Fixed seconds of one all-to-all or grouped post in which a rank talks to `intra_peers` peers on its
  /// node and `inter_peers` on other nodes (0 when it talks to none).
  [[nodiscard]] double fixed_comm_seconds(int intra_peers, int inter_peers) const noexcept {
    if (intra_peers + inter_peers <= 0) return 0.0;
    return collective_latency + intra_peers * peer_latency_intra + inter_peers * peer_latency_inter;
  }
  /// Ranks of one NVLink domain on a node of `node_ranks` ranks (nvlink_domain).
  [[nodiscard]] int domain_ranks(int node_ranks) const noexcept {
    return nvlink_domain > 0 ? std::min(nvlink_domain, node_ranks) : node_ranks;
  }
  /// Whether local ranks `a` and `b` of one node (their positions on it) share an NVLink domain.
  [[nodiscard]] bool same_domain(int a, int b) const noexcept {
    return nvlink_domain <= 0 || a / nvlink_domain == b / nvlink_domain;
  }
  /// Whether `host` is modelled (HardwareProfile::host).
  [[nodiscard]] bool has_host_link() const noexcept { return host.bandwidth > 0; }
  /// Ranks sharing one NIC.
  [[nodiscard]] int ranks_per_nic() const noexcept { return std::max(1, ranks_per_node / std::max(1, nics_per_node)); }

  void validate(const char* where = "HardwareProfile") const {
    detail::require(peak_flops > 0 && std::isfinite(peak_flops), where, "peak_flops", peak_flops, "must be > 0");
    detail::require(gemm_efficiency > 0 && gemm_efficiency <= 1, where, "gemm_efficiency", gemm_efficiency,
                    "must be in (0, 1]");
    detail::require(attention_efficiency > 0 && attention_efficiency <= 1, where, "attention_efficiency",
                    attention_efficiency, "must be in (0, 1]");
    detail::require(attention_tile >= 1, where, "attention_tile", attention_tile, "must be >= 1");
    detail::require(attention_tile_overhead >= 0, where, "attention_tile_overhead", attention_tile_overhead,
                    "must be >= 0");
    detail::require(attention_half_length >= 0, where, "attention_half_length", attention_half_length, "must be >= 0");
    detail::require(attention_backward_factor > 0 && attention_backward_factor <= 2, where, "attention_backward_factor",
                    attention_backward_factor, "must be in (0, 2]");
    detail::require(kernel_launch >= 0, where, "kernel_launch", kernel_launch, "must be >= 0");
    detail::require(collective_latency >= 0 && std::isfinite(collective_latency), where, "collective_latency",
                    collective_latency, "must be finite and >= 0");
    detail::require(peer_latency_intra >= 0 && std::isfinite(peer_latency_intra), where, "peer_latency_intra",
                    peer_latency_intra, "must be finite and >= 0");
    detail::require(peer_latency_inter >= 0 && std::isfinite(peer_latency_inter), where, "peer_latency_inter",
                    peer_latency_inter, "must be finite and >= 0");
    detail::require(copy_launch >= 0 && std::isfinite(copy_launch), where, "copy_launch", copy_launch,
                    "must be finite and >= 0");
    detail::require(hbm_bandwidth > 0, where, "hbm_bandwidth", hbm_bandwidth, "must be > 0");
    detail::require(intra.bandwidth > 0, where, "intra.bandwidth", intra.bandwidth, "must be > 0");
    detail::require(inter.bandwidth > 0, where, "inter.bandwidth", inter.bandwidth, "must be > 0");
    detail::require(intra.latency >= 0, where, "intra.latency", intra.latency, "must be >= 0");
    detail::require(inter.latency >= 0, where, "inter.latency", inter.latency, "must be >= 0");
    detail::require(ranks_per_node >= 1, where, "ranks_per_node", ranks_per_node, "must be >= 1");
    detail::require(nics_per_node >= 1, where, "nics_per_node", nics_per_node, "must be >= 1");
    detail::require(nvlink_domain >= 0, where, "nvlink_domain", nvlink_domain, "must be >= 0");
    detail::require(host.bandwidth >= 0 && std::isfinite(host.bandwidth), where, "host.bandwidth", host.bandwidth,
                    "must be finite and >= 0");
    detail::require(host.latency >= 0 && std::isfinite(host.latency), where, "host.latency", host.latency,
                    "must be finite and >= 0");
    detail::require(nvlink_domain == 0 || host.bandwidth > 0, where, "host.bandwidth", host.bandwidth,
                    "must be > 0 when nvlink_domain = " + std::to_string(nvlink_domain) +
                        " splits a node (traffic between NVLink domains crosses it)");
    detail::require(memory_bytes > 0, where, "memory_bytes", memory_bytes, "must be > 0");
    detail::require(cores_per_node >= 0, where, "cores_per_node", cores_per_node, "must be >= 0");
    detail::require(value_bytes == 2 || value_bytes == 4 || value_bytes == 8, where, "value_bytes", value_bytes,
                    "must be 2, 4 or 8");
  }
};

namespace profiles {

inline constexpr double kGB = 1e9;
inline constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

/// A100-SXM4-40GB, 2 nodes x 4 GPUs with one 400 Gb/s NIC per node: the BASP paper's cluster.
/// Peak 312 TFLOP/s bf16 dense; NVLink 3 with NCCL ~230 GB/s busbw (nccl-tests#149); one NDR NIC ~48 GB/s
/// achievable (nccl-tests#290), shared by the node's 4 GPUs; alpha 10 us intra (nccl-tests#123: 10-34 us
/// small all_reduce; p2p ~3 us) and 20 us inter (nccl-tests#150); HBM2 1.555 TB/s; MFU 49% at 16K
/// (llm-foundry, A100-40GB); FA2 ~70% of peak on long tiles (flash-attention#1059).
/// Fixed costs (issue 16; anchors-hw.md 1.2, 1.4 and the sources named):
///  - collective_latency 10 us: a tiny NCCL call on 2 A100 takes 10 us (nccl-tests#123, 1 channel); an 8-GPU
///    H20 all-to-all of 128 B-4 KB 10.5-11.1 us (DeepEP#303); NCCL's own tuning base latency is 6.6-14 us
///    per call (src/graph/tuning.cc);
///  - peer_latency_intra 3 us: NVLink P2P write ~3 us (nccl-tests#123; H100 sendrecv 3 us, nccl#1487); NCCL
///    all-to-all of 64 KB on NVSwitch grows 20.8 -> 56 us from 4 to 8 GPUs (TensorRT-LLM#15285), 3-9 us a peer;
///  - peer_latency_inter 14 us: NCCL's NET ring step latency with the Simple protocol (tuning.cc hwLat,
///    {2.7, 4.0, 14.0} us for LL, LL128, Simple; large messages use Simple); 2 nodes' 8-byte all_reduce
///    takes 19-20 us (nccl-tests#150);
///  - copy_launch 5 us: a kernel launch, as kernel_launch.
[[nodiscard]] inline HardwareProfile a100_40gb() {
  HardwareProfile p;
  p.name = "a100-40gb";
  p.peak_flops = 312e12;
  p.gemm_efficiency = 0.49;
  p.attention_efficiency = 0.65;
  p.attention_tile = 128;
  p.attention_tile_overhead = 1.9;
  p.kernel_launch = 5e-6;
  p.collective_latency = 10e-6;
  p.peer_latency_intra = 3e-6;
  p.peer_latency_inter = 14e-6;
  p.copy_launch = 5e-6;
  p.hbm_bandwidth = 1555 * kGB;
  p.intra = {230 * kGB, 10e-6};
  p.inter = {48 * kGB, 20e-6};
  p.ranks_per_node = 4;
  p.nics_per_node = 1;
  p.memory_bytes = 40 * kGiB;
  return p;
}

/// The BASP paper's node layout is not given (2 nodes x 4 A100-40GB, "NVLink", 400 Gb/s InfiniBand);
/// a100_40gb() above is one reading of it. These are the others a 4-GPU A100-40GB node can have, each
/// the same GPU with the same fixed costs, so that the replay can say which reading its results need:
///  - a100_40gb(): HGX A100 4-GPU, every pair of GPUs on NVLink 3 (4 links each, 230 GB/s a GPU to all
///    its peers), one 400 Gb/s port per node (~48 GB/s; 2 x HDR 200 Gb/s NICs give the same per-rank
///    share, 2 x ~24 GB/s for 4 GPUs) [the default]. Not modelled: one 400 Gb/s NIC in a PCIe Gen4 x16
///    slot (A100 hosts are Gen4) would reach only ~25 GB/s a node, which slows Ulysses, not BASP;
///  - a100_40gb_nic_per_gpu(): the same node with one NIC per GPU. A100 hosts are PCIe Gen4, so a GPU
///    reaches its NIC at most at its x16 Gen4 link's rate: 32 GB/s line (A100 datasheet: PCIe Gen4
///    64 GB/s both directions), 25 GB/s measured peak (BaM, ZaidQureshi/bam#54); NCCL gets ~21-24 GB/s
///    a NIC from 4 HDR NICs per 8 A100-SXM4-40GB (85-96 GB/s busbw, nccl-tests#119): 24 GB/s a NIC;
///  - a100_40gb_pcie_pairs(): A100-40GB PCIe cards, NVLink only within bridged pairs (3 bridges, 12
///    links, 600 GB/s both directions: A100 40GB PCIe product brief PB-10137-001; nvidia.com: NVLink
///    "also available in A100 PCIe two-GPU configurations"): NCCL all_reduce busbw 208 GB/s on a
///    bridged pair and 20 GB/s once the ring crosses PCIe to the other pair (nccl-tests#178, 8 A100
///    PCIe in NV12 pairs): nvlink_domain 2, intra 208 GB/s, host 20 GB/s; one NIC per node as the
///    default. Alpha over PCIe: the default's 10 us (no separate figure found: the call's cost
///    dominates small messages). Compute is kept at the SXM4's (the 250 W card runs at ~90% of it by
///    NVIDIA's own rating), so these layouts differ in their links only;
///  - a100_40gb_pcie_pairs_nic_per_gpu(): the pairs with one NIC per GPU (24 GB/s as above); the GPU's
///    PCIe link then carries both its cross-pair and its inter-node traffic.
[[nodiscard]] inline HardwareProfile a100_40gb_nic_per_gpu() {
  HardwareProfile p = a100_40gb();
  p.name = "a100-40gb-nic-per-gpu";
  p.inter = {24 * kGB, 20e-6};
  p.nics_per_node = 4;
  return p;
}

[[nodiscard]] inline HardwareProfile a100_40gb_pcie_pairs() {
  HardwareProfile p = a100_40gb();
  p.name = "a100-40gb-pcie-pairs";
  p.intra = {208 * kGB, 10e-6};
  p.nvlink_domain = 2;
  p.host = {20 * kGB, 10e-6};
  return p;
}

[[nodiscard]] inline HardwareProfile a100_40gb_pcie_pairs_nic_per_gpu() {
  HardwareProfile p = a100_40gb_pcie_pairs();
  p.name = "a100-40gb-pcie-pairs-nic-per-gpu";
  p.inter = {24 * kGB, 20e-6};
  p.nics_per_node = 4;
  return p;
}

/// A800-SXM4-80GB (A100 with NVLink capped at 400 GB/s bidirectional = 200 GB/s per direction), 8 per node,
/// one 400 Gb/s IB per node (the DPP paper's cluster; seeds digest). 312 TFLOP/s bf16; HBM2e 2.0 TB/s;
/// MFU 52% (llm-foundry, A100-80GB at 16K).
[[nodiscard]] inline HardwareProfile a800_80gb() {
  HardwareProfile p = a100_40gb();
  p.name = "a800-80gb";
  p.gemm_efficiency = 0.52;
  p.hbm_bandwidth = 2039 * kGB;
  p.intra = {170 * kGB, 10e-6};  // 200 GB/s/dir link, ~85% NCCL efficiency
  p.inter = {48 * kGB, 20e-6};
  p.ranks_per_node = 8;
  p.nics_per_node = 1;
  p.memory_bytes = 80 * kGiB;
  return p;
}

/// H100-SXM5-80GB, DGX/HGX: 8 per node, NVLink 4 (NCCL ~370 GB/s busbw, nccl-tests#212), one 400 Gb/s
/// NDR NIC per GPU (~46-49 GB/s achievable, nccl-tests#319). 989 TFLOP/s bf16 dense; FA3 616 TFLOP/s
/// on 16K causal, 292 on 512-token documents (efficiency 0.65 with 128-blocks gives 620 and 292); MFU ~40% (Llama 3:
/// 38-43%); HBM3 3.35 TB/s; alpha 3 us p2p intra (nccl#1487), ~15 us inter. Fixed costs as the A100's
/// (same NCCL tuning constants; H100/H800 sendrecv 3-3.7 us intra, nccl#1487, #1984).
[[nodiscard]] inline HardwareProfile h100_sxm() {
  HardwareProfile p;
  p.name = "h100-sxm";
  p.peak_flops = 989e12;
  p.gemm_efficiency = 0.40;
  p.attention_efficiency = 0.65;
  p.attention_tile = 128;
  p.attention_tile_overhead = 1.9;
  p.kernel_launch = 5e-6;
  p.collective_latency = 10e-6;
  p.peer_latency_intra = 3e-6;
  p.peer_latency_inter = 14e-6;
  p.copy_launch = 5e-6;
  p.hbm_bandwidth = 3350 * kGB;
  p.intra = {370 * kGB, 3e-6};
  p.inter = {46 * kGB, 15e-6};
  p.ranks_per_node = 8;
  p.nics_per_node = 8;
  p.memory_bytes = 80 * kGiB;
  return p;
}

/// H200-SXM-141GB: H100 compute (989 TFLOP/s bf16), HBM3e 4.8 TB/s, 141 GB, same NVLink 4 / NDR fabric.
[[nodiscard]] inline HardwareProfile h200() {
  HardwareProfile p = h100_sxm();
  p.name = "h200";
  p.hbm_bandwidth = 4800 * kGB;
  p.memory_bytes = 141 * kGB;
  return p;
}

[[nodiscard]] inline std::vector<std::string> names() {
  return {"a100-40gb",
          "a100-40gb-nic-per-gpu",
          "a100-40gb-pcie-pairs",
          "a100-40gb-pcie-pairs-nic-per-gpu",
          "a800-80gb",
          "h100-sxm",
          "h200"};
}

/// The named profile (case-insensitive; "a100", "a800", "h100" accepted). Throws naming the name.
[[nodiscard]] inline HardwareProfile by_name(std::string_view name) {
  std::string n(name);
  std::transform(n.begin(), n.end(), n.begin(), [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  if (n == "a100-40gb" || n == "a100") return a100_40gb();
  if (n == "a100-40gb-nic-per-gpu") return a100_40gb_nic_per_gpu();
  if (n == "a100-40gb-pcie-pairs") return a100_40gb_pcie_pairs();
  if (n == "a100-40gb-pcie-pairs-nic-per-gpu") return a100_40gb_pcie_pairs_nic_per_gpu();
  if (n == "a800-80gb" || n == "a800") return a800_80gb();
  if (n == "h100-sxm" || n == "h100") return h100_sxm();
  if (n == "h200") return h200();
  std::string known;
  for (const auto& k : names()) known += (known.empty() ? "" : ", ") + k;
  detail::throw_invalid("replay::profiles::by_name", "name", std::string(name),
                        "is not a known profile (" + known + ")");
}

}  // namespace profiles
}  // namespace seqpar::replay
