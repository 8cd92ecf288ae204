// SPDX-License-Identifier: Apache-2.0
// The simulator against hand-computed alpha-beta and roofline figures, and its failure modes.
#include <doctest/doctest.h>

#include "support/expect_error.hpp"

#include <seqpar/plan/compile_all.hpp>
#include <seqpar/replay/costs.hpp>
#include <seqpar/replay/predict.hpp>
#include <seqpar/replay/simulator.hpp>
#include <seqpar/seqpar.hpp>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>

using namespace seqpar;
using seqpar::test::invalid_message;

namespace {

// Round numbers, copies free (huge HBM bandwidth), no launch cost: times are easy to write down.
replay::HardwareProfile round_profile() {
  replay::HardwareProfile p;
  p.name = "round";
  p.peak_flops = 1e12;
  p.gemm_efficiency = 1.0;
  p.attention_efficiency = 1.0;
  p.attention_backward_factor = 1.0;
  p.kernel_launch = 0;
  p.hbm_bandwidth = 1e30;
  p.intra = {1e9, 1e-6};
  p.inter = {1e8, 1e-5};
  p.ranks_per_node = 2;
  p.nics_per_node = 1;
  p.memory_bytes = 1e12;
  p.value_bytes = 2;
  return p;
}

replay::SimulationOptions options(const replay::HardwareProfile& hw) {
  replay::SimulationOptions o;
  o.hardware = hw;
  return o;
}

// Ulysses' forward on `ranks` ranks of a 4000-token batch, heads h:h, d 32, fp16: two balanced exchanges
// (Q, K, V; then O and its fp32 LSE), priced by the closed form.
double ulysses_forward_seconds(const replay::HardwareProfile& hw, const Topology& topo, int ranks = 4, int h = 4) {
  const double rows = 4000.0 / ranks, qkv = rows * 3 * h * 32 * 2, o = rows * h * 32 * 2 + rows * h * 4;
  return replay::all_to_all_seconds(hw, topo, ranks, qkv) + replay::all_to_all_seconds(hw, topo, ranks, o);
}

// A profile with the fixed costs and the copies taken out: only links and their alphas are left.
replay::HardwareProfile links_only(replay::HardwareProfile hw) {
  hw.collective_latency = hw.peer_latency_intra = hw.peer_latency_inter = 0;
  hw.copy_launch = hw.kernel_launch = 0;
  hw.hbm_bandwidth = 1e30;
  hw.peak_flops = 1e30;
  return hw;
}

}  // namespace

TEST_SUITE("replay") {
  TEST_CASE("attention_slots: exact area without tiles, whole blocks with them") {
    const AttnSlice causal{{0, 512}, {0, 512}, Mask::causal()};
    CHECK(replay::attention_slots(causal, 1, 0) == causal.area());
    // 4 query blocks touching 1, 2, 3, 4 key blocks, plus 1.9 blocks of overhead each.
    CHECK(replay::attention_slots(causal, 128, 1.9) == doctest::Approx((10 + 4 * 1.9) * 128 * 128));
    const AttnSlice full{{0, 200}, {0, 300}, Mask::full()};
    CHECK(replay::attention_slots(full, 128, 0) == 2 * 3 * 128 * 128);
    // A fully masked slice costs nothing; with tile 1 the overhead counts rows that see a key.
    CHECK(replay::attention_slots({{0, 10}, {0, 10}, Mask::causal(-20)}, 128, 1.9) == 0);
    CHECK(replay::attention_slots({{0, 10}, {0, 10}, Mask::causal(-3)}, 1, 1.0) == doctest::Approx(28 + 7));
  }

  TEST_CASE("one rank: the step time is the kernel's FLOPs at the profile's rate") {
    const DocumentBatch batch({{300, 700}});
    const AttentionShape shape{4, 2, 64, 0};
    const Topology topo{1, 1};
    using Ulysses = Strategy<partition::Uniform, comm::AllToAll>;
    const auto p = plan::predict<Ulysses>({}, batch, shape, topo, options(round_profile()));
    REQUIRE(p.status);
    const double pairs = 300.0 * 301 / 2 + 700.0 * 701 / 2;
    CHECK(p.forward.time_s == doctest::Approx(4.0 * 64 * 4 * pairs / 1e12));
    CHECK(p.backward.time_s == doctest::Approx(2.5 * 4.0 * 64 * 4 * pairs / 1e12));
    CHECK(p.forward.ranks[0].compute_s == doctest::Approx(p.forward.time_s));
    CHECK(p.forward.ranks[0].exposed_comm_s == 0);
  }

  TEST_CASE("ring on two ranks: one transfer, alpha + bytes / bandwidth, hidden behind compute or not") {
    const DocumentBatch batch = DocumentBatch::single({1000});
    const AttentionShape shape{4, 2, 64, 0};
    using ZigzagRing = Strategy<partition::Zigzag, comm::Ring>;
    replay::HardwareProfile hw = round_profile();
    hw.peak_flops = 1e30;  // communication only
    for (const int per_node : {2, 1}) {
      CAPTURE(per_node);
      const Topology topo{2, per_node};
      const auto c = plan::compile_all<ZigzagRing>({}, batch, shape, topo);
      const auto rep = replay::predict(c, topo, shape, options(hw)).forward;
      // Each rank sends its 500 tokens of K and V (2 heads x 64 x 2 bytes each) to the other.
      const double bytes = 500.0 * 2 * 2 * 64 * 2;
      const replay::LinkClass link = per_node == 2 ? hw.intra : hw.inter;
      CHECK(rep.time_s == doctest::Approx(link.latency + bytes / link.bandwidth).epsilon(1e-6));
      for (int r = 0; r < 2; ++r) {
        const auto& rt = rep.ranks[static_cast<std::size_t>(r)];
        CHECK(rt.bytes_intra + rt.bytes_inter == c.forward[static_cast<std::size_t>(r)].bytes_sent(2, 4));
        CHECK((per_node == 2 ? rt.bytes_inter : rt.bytes_intra) == 0);
      }
    }
    // With compute much longer than the transfer, the ring hides it: time = compute of the slower rank.
    const Topology topo{2, 2};
    hw.peak_flops = 1e9;
    const auto rep = plan::predict<ZigzagRing>({}, batch, shape, topo, options(hw)).forward;
    double slowest = 0;
    for (const auto& r : rep.ranks) slowest = std::max(slowest, r.compute_s);
    CHECK(rep.time_s == doctest::Approx(slowest).epsilon(1e-6));
    CHECK(rep.ranks[0].comm_s > 0);
  }

  TEST_CASE("all-to-all across nodes: the node's NIC carries every rank's inter-node bytes") {
    const DocumentBatch batch = DocumentBatch::single({4000});
    const AttentionShape shape{4, 4, 32, 0};
    using Ulysses = Strategy<partition::Uniform, comm::AllToAll>;
    replay::HardwareProfile hw = round_profile();
    hw.peak_flops = 1e30;
    const Topology topo{4, 2};
    const auto c = plan::compile_all<Ulysses>({}, batch, shape, topo);
    const auto rep = replay::predict(c, topo, shape, options(hw)).forward;
    // Forward = two exchanges (Q, K, V to head shards; O and LSE back). In each, every rank sends half
    // its off-rank bytes to the other node; one NIC per node carries both of its ranks' share.
    double node_out_first = 0;
    for (int r = 0; r < 2; ++r)
      node_out_first += static_cast<double>(rep.ranks[static_cast<std::size_t>(r)].bytes_inter);
    CHECK(rep.ranks[0].bytes_inter > 0);
    CHECK(rep.time_s >= node_out_first / hw.inter.bandwidth);
    CHECK(rep.time_s <= node_out_first / hw.inter.bandwidth + 2 * hw.inter.latency + 1e-9 +
                            static_cast<double>(rep.ranks[0].bytes_intra) / hw.intra.bandwidth);
  }

  TEST_CASE("all_to_all_seconds: the closed form of a balanced exchange is what the replay charges for it") {
    replay::HardwareProfile hw = round_profile();
    const Topology topo{4, 2};
    // Inside a node: 1 of 2 quarters crosses NVLink. Across: each rank sends half its bytes off the node,
    // and the node's one NIC carries both ranks' share.
    const double bytes = 1e6;
    CHECK(replay::all_to_all_seconds(hw, Topology{2, 2}, 2, bytes) ==
          doctest::Approx(hw.intra.latency + bytes / 2 / hw.intra.bandwidth));
    CHECK(replay::all_to_all_seconds(hw, topo, 4, bytes) ==
          doctest::Approx(hw.inter.latency + std::max(bytes / 4 / hw.intra.bandwidth, bytes / hw.inter.bandwidth)));
    CHECK(replay::all_to_all_seconds(hw, topo, 1, bytes) == 0);
    // Ulysses' forward on 4 ranks is two such exchanges (Q, K, V; then O and its LSE).
    const DocumentBatch batch = DocumentBatch::single({4000});
    const AttentionShape shape{4, 4, 32, 0};
    hw.peak_flops = 1e30;
    hw.kernel_launch = 0;
    const auto c = plan::compile_all<Strategy<partition::Uniform, comm::AllToAll>>({}, batch, shape, topo);
    const auto rep = replay::predict(c, topo, shape, options(hw)).forward;
    CHECK(rep.time_s == doctest::Approx(ulysses_forward_seconds(hw, topo)).epsilon(1e-6));
  }

  TEST_CASE("NVLink domains: traffic between a node's bridged pairs crosses PCIe, in the closed form and the replay") {
    replay::HardwareProfile hw = round_profile();
    hw.peak_flops = 1e30;
    hw.ranks_per_node = 4;
    hw.nvlink_domain = 2;
    hw.host = {2.5e8, 3e-6};
    const Topology topo{4, 4};
    const double bytes = 1e6;
    // A 4-way exchange: a quarter to the pair peer over NVLink, two quarters over the rank's PCIe link.
    CHECK(replay::all_to_all_seconds(hw, topo, 4, bytes) ==
          doctest::Approx(3e-6 + std::max(bytes / 4 / 1e9, bytes / 2 / 2.5e8)));
    CHECK(replay::all_to_all_seconds(hw, topo, 2, bytes) == doctest::Approx(1e-6 + bytes / 2 / 1e9));  // one pair
    replay::HardwareProfile mesh = hw;  // every pair on NVLink
    mesh.nvlink_domain = 0;
    mesh.host = {};
    CHECK(replay::all_to_all_seconds(mesh, topo, 4, bytes) == doctest::Approx(1e-6 + 3 * bytes / 4 / 1e9));
    // Three ranks: the lone rank of the second domain sends two thirds over PCIe, the pair one third.
    CHECK(replay::all_to_all_seconds(hw, Topology{3, 4}, 3, bytes) ==
          doctest::Approx(3e-6 + std::max(bytes / 3 / 1e9, 2 * bytes / 3 / 2.5e8)));
    // The replay charges Ulysses' exchanges what the closed form says, with the domains and without.
    const DocumentBatch batch = DocumentBatch::single({4000});
    const AttentionShape shape{4, 4, 32, 0};
    const auto c = plan::compile_all<Strategy<partition::Uniform, comm::AllToAll>>({}, batch, shape, topo);
    const auto split = replay::predict(c, topo, shape, options(hw)).forward;
    const auto whole = replay::predict(c, topo, shape, options(mesh)).forward;
    CHECK(split.time_s == doctest::Approx(ulysses_forward_seconds(hw, topo)).epsilon(1e-6));
    CHECK(whole.time_s == doctest::Approx(ulysses_forward_seconds(mesh, topo)).epsilon(1e-6));
    // PCIe at a quarter of NVLink's rate carries half of each rank's bytes: (1/2) / 0.25 against (3/4) / 1.
    CHECK(split.time_s > 2.5 * whole.time_s);
    for (const auto& r : split.ranks) CHECK(r.bytes_inter == 0);  // PCIe inside a node is still intra-node
    // Ring collectives: a ring over both pairs runs at the PCIe link's rate, one inside a pair at NVLink's.
    CHECK(replay::ring_busbw(hw, topo, 4) == 2.5e8);
    CHECK(replay::ring_busbw(hw, topo, 2) == 1e9);
    CHECK(replay::ring_collective_seconds(hw, topo, 4, bytes) ==
          doctest::Approx(3e-6 + 3 * 1.0e-6 + 0.75 * bytes / 2.5e8));

    // A point-to-point transfer: a ring step between two domains goes over PCIe (alpha + bytes / bandwidth),
    // and across nodes a modelled host link bounds the NIC's rate.
    using ZigzagRing = Strategy<partition::Zigzag, comm::Ring>;
    const AttentionShape kv{4, 2, 64, 0};
    const DocumentBatch one = DocumentBatch::single({1000});
    const double ring_bytes = 500.0 * 2 * 2 * 64 * 2;  // each rank's 500 tokens of K and V
    replay::HardwareProfile solo = round_profile();    // each rank its own domain
    solo.peak_flops = 1e30;
    solo.nvlink_domain = 1;
    solo.host = {2.5e8, 3e-6};
    const Topology pair{2, 2};
    CHECK(plan::predict<ZigzagRing>({}, one, kv, pair, options(solo)).forward.time_s ==
          doctest::Approx(3e-6 + ring_bytes / 2.5e8).epsilon(1e-6));
    solo.nvlink_domain = 0;
    solo.host = {5e7, 3e-6};  // slower than the NIC (1e8): the GPU's PCIe link sets the rate
    const Topology apart{2, 1};
    CHECK(plan::predict<ZigzagRing>({}, one, kv, apart, options(solo)).forward.time_s ==
          doctest::Approx(solo.inter.latency + ring_bytes / 5e7).epsilon(1e-6));
    CHECK(plan::predict<ZigzagRing>({}, one, kv, pair, options(solo)).forward.time_s ==
          doctest::Approx(solo.intra.latency + ring_bytes / solo.intra.bandwidth).epsilon(1e-6));  // NVLink
  }

  TEST_CASE("BASP's all-to-all ratio over Ulysses follows the node layout (the BASP paper's 2 x 4 A100-40GB)") {
    // Per rank b bytes; Ulysses exchanges over all 8 ranks of 2 nodes x 4, BASP over the 4 of a node. Links
    // only (no fixed costs, no copies): the ratio is the closed form of each layout's busiest link.
    const Topology topo{8, 4};
    const double b = 64e6;
    const auto ratio = [&](const replay::HardwareProfile& p) {
      const replay::HardwareProfile hw = links_only(p);
      return replay::all_to_all_seconds(hw, topo, 8, b) / replay::all_to_all_seconds(hw, topo, 4, b);
    };
    const double basp_nvlink = 10e-6 + 0.75 * b / 230e9;  // 3 peers x b/4 on NVLink
    const double basp_pcie = 10e-6 + 0.5 * b / 20e9;      // 2 of them across PCIe
    // Default, HGX 4-GPU with one NIC a node: Ulysses' 4 ranks x 4 remote peers x b/8 through one 48 GB/s NIC.
    const double by_default = ratio(replay::profiles::a100_40gb());
    CHECK(by_default == doctest::Approx((20e-6 + 2 * b / 48e9) / basp_nvlink));
    // One NIC a GPU: Ulysses sends b/2 through its own 24 GB/s NIC.
    const double nic_per_gpu = ratio(replay::profiles::a100_40gb_nic_per_gpu());
    CHECK(nic_per_gpu == doctest::Approx((20e-6 + 0.5 * b / 24e9) / basp_nvlink));
    // PCIe pairs, one NIC a node: Ulysses still waits on the shared NIC (its PCIe link's 3/4 b at 20 GB/s is
    // less); BASP now sends half its bytes over PCIe.
    const double pairs = ratio(replay::profiles::a100_40gb_pcie_pairs());
    CHECK(pairs == doctest::Approx((20e-6 + 2 * b / 48e9) / basp_pcie));
    // PCIe pairs, one NIC a GPU: Ulysses' PCIe link carries 2 cross-pair and 4 inter-node eighths.
    const double pairs_nic = ratio(replay::profiles::a100_40gb_pcie_pairs_nic_per_gpu());
    CHECK(pairs_nic == doctest::Approx((20e-6 + 0.75 * b / 20e9) / basp_pcie));
    // The direction: the faster Ulysses' path off the node, or the slower BASP's inside it, the smaller.
    CHECK(by_default > nic_per_gpu);
    CHECK(nic_per_gpu > pairs);
    CHECK(pairs > pairs_nic);
    CHECK(pairs_nic > 1.0);
    // The replay agrees with the closed form for Ulysses on 8 ranks of the PCIe-pairs node.
    const replay::HardwareProfile hw = links_only(replay::profiles::a100_40gb_pcie_pairs_nic_per_gpu());
    const DocumentBatch batch = DocumentBatch::single({4000});
    const AttentionShape shape{8, 8, 32, 0};
    const auto c = plan::compile_all<Strategy<partition::Uniform, comm::AllToAll>>({}, batch, shape, topo);
    CHECK(replay::predict(c, topo, shape, options(hw)).forward.time_s ==
          doctest::Approx(ulysses_forward_seconds(hw, topo, 8, 8)).epsilon(1e-6));
  }

  TEST_CASE("fixed costs: an exchange pays one call and a handshake per peer, a copy its launch gap") {
    replay::HardwareProfile hw = round_profile();
    hw.peak_flops = 1e30;
    const Topology topo{4, 2};
    const DocumentBatch batch = DocumentBatch::single({4000});
    const AttentionShape shape{4, 4, 32, 0};
    const auto c = plan::compile_all<Strategy<partition::Uniform, comm::AllToAll>>({}, batch, shape, topo);
    const double bare = replay::predict(c, topo, shape, options(hw)).forward.time_s;
    hw.collective_latency = 1e-4;
    hw.peer_latency_intra = 1e-5;
    hw.peer_latency_inter = 5e-5;
    CHECK(hw.fixed_comm_seconds(1, 2) == doctest::Approx(1e-4 + 1e-5 + 2 * 5e-5));
    CHECK(hw.fixed_comm_seconds(0, 0) == 0);
    // Ulysses' forward: two exchanges, each rank talking to 1 peer on its node and 2 on the other.
    const double fixed = replay::predict(c, topo, shape, options(hw)).forward.time_s;
    CHECK(fixed - bare == doctest::Approx(2 * hw.fixed_comm_seconds(1, 2)).epsilon(1e-9));
    CHECK(fixed == doctest::Approx(ulysses_forward_seconds(hw, topo)).epsilon(1e-6));
    // A launch gap per copy kernel: each exchange packs and unpacks, 4 copies in a row on every rank.
    hw.copy_launch = 3e-6;
    CHECK(replay::predict(c, topo, shape, options(hw)).forward.time_s - fixed == doctest::Approx(4 * 3e-6));
    // A ring step is a grouped post of one send: one call and one peer on the transfer.
    hw.copy_launch = 0;
    const Topology pair{2, 2};
    const auto ring = plan::compile_all<Strategy<partition::Uniform, comm::Ring>>({}, batch, shape, pair);
    const auto with = replay::simulate(ring.forward, pair, shape, options(hw));
    const auto without = replay::simulate(ring.forward, pair, shape, options(round_profile()));
    CHECK(with.ranks[0].comm_s - without.ranks[0].comm_s ==
          doctest::Approx(2 * hw.fixed_comm_seconds(1, 0)).epsilon(1e-9));  // a send and a receive, one each
  }

  TEST_CASE("all-gather: the gather flies while the local rows are attended, as the ring's first step") {
    // Compute-heavy: the local part of each rank's attention takes longer than the gather, so no rank
    // waits for it (the blocking all-to-all it replaced waited for all of it before any compute).
    replay::HardwareProfile hw = round_profile();
    hw.peak_flops = 1e11;
    const Topology topo{2, 2};
    const DocumentBatch batch = DocumentBatch::single({2000});
    const AttentionShape shape{1, 1, 32, 0};
    for (const bool aware : {false, true}) {
      INFO("sharding_aware " << aware);
      Strategy<partition::Zigzag, comm::AllGather>::Arguments args;
      args.comm.sharding_aware = aware;
      const auto c = plan::compile_all<Strategy<partition::Zigzag, comm::AllGather>>(args, batch, shape, topo);
      const auto rep = replay::predict(c, topo, shape, options(hw));
      for (const auto* r : {&rep.forward, &rep.backward})
        for (const replay::RankTiming& t : r->ranks) {
          CHECK(t.comm_s > 0);
          CHECK(t.bytes_intra > 0);
        }
      for (const replay::RankTiming& t : rep.forward.ranks) CHECK(t.exposed_comm_s == 0);
      // Backward: the gather hides under the local gradient; only the gradient return, which must wait
      // for the gathered rows' gradients, can be exposed.
      for (const replay::RankTiming& t : rep.backward.ranks) CHECK(t.exposed_comm_s < t.comm_s / 2);
    }
  }

  TEST_CASE("replays are shift-invariant and report the programs' bytes") {
    const DocumentBatch batch({{1500, 500, 2096}, {4096}});
    const AttentionShape shape{8, 2, 64, 0};
    const Topology topo{4, 2};
    using HybridRing = Strategy<partition::Hybrid, comm::Ring>;
    HybridRing::Arguments args;
    args.comm.sharding_aware = true;
    const auto c = plan::compile_all<HybridRing>(args, batch, shape, topo);
    REQUIRE(c.status);
    const replay::Replay replay(c.forward, topo, shape, options(replay::profiles::h100_sxm()));
    const auto a = replay.run();
    const std::vector<double> later(4, 2.5);
    const auto b = replay.run(later);
    CHECK(b.time_s == doctest::Approx(a.time_s));
    for (std::size_t r = 0; r < 4; ++r) {
      CHECK(b.ranks[r].end_s == doctest::Approx(a.ranks[r].end_s + 2.5));
      CHECK(a.ranks[r].bytes_intra + a.ranks[r].bytes_inter == c.forward[r].bytes_sent(2, 4));
    }
  }

  TEST_CASE("the trace is Chrome trace-event JSON with one complete event per recorded interval") {
    const DocumentBatch batch({{800, 1200}});
    const AttentionShape shape{4, 2, 64, 0};
    const Topology topo{2, 2};
    auto opt = options(replay::profiles::a100_40gb());
    opt.trace = true;
    const auto p = plan::predict<Strategy<partition::Zigzag, comm::Ring>>({}, batch, shape, topo, opt);
    REQUIRE(!p.forward.trace.events.empty());
    const std::string path = "seqpar_test_trace.json";
    p.forward.trace.write(path);
    std::ifstream in(path);
    std::stringstream text;
    text << in.rdbuf();
    const std::string s = text.str();
    CHECK(s.rfind("{\"displayTimeUnit\": \"ms\", \"traceEvents\": [", 0) == 0);
    std::size_t complete = 0;
    for (std::size_t at = s.find("\"ph\": \"X\""); at != std::string::npos; at = s.find("\"ph\": \"X\"", at + 1))
      ++complete;
    CHECK(complete == p.forward.trace.events.size());
    CHECK(s.find("\"rank 1 comm\"") != std::string::npos);
    std::remove(path.c_str());
    CHECK_THROWS_AS(p.forward.trace.write("/nonexistent-dir/x.json"), std::runtime_error);
  }

  TEST_CASE("bad input: clear errors, and mismatched programs are reported, not hung on") {
    const DocumentBatch batch = DocumentBatch::single({1000});
    const AttentionShape shape{4, 2, 64, 0};
    const Topology topo{2, 2};
    auto c = plan::compile_all<Strategy<partition::Zigzag, comm::Ring>>({}, batch, shape, topo);
    const auto opt = options(replay::profiles::h100_sxm());
    CHECK(invalid_message([&] {
            (void)replay::Replay(std::span(c.forward).first(1), topo, shape, opt);
          }).find("programs.size() = 1") != std::string::npos);
    auto bad = opt;
    bad.hardware.intra.bandwidth = 0;
    CHECK(invalid_message([&] { (void)replay::Replay(c.forward, topo, shape, bad); }).find("intra.bandwidth = 0") !=
          std::string::npos);
    // Rank 1 never posts its receive: the replay must say the programs do not match.
    auto broken = c.forward;
    std::erase_if(broken[1].steps, [](const comm::Step& s) { return std::holds_alternative<comm::PostStep>(s); });
    std::erase_if(broken[1].steps, [](const comm::Step& s) { return std::holds_alternative<comm::WaitStep>(s); });
    CHECK_THROWS_AS((void)replay::Replay(broken, topo, shape, opt).run(), std::logic_error);
    // Rank 1 skips its all-to-all: rank 0 would wait forever; the replay reports a deadlock.
    auto u = plan::compile_all<Strategy<partition::Uniform, comm::AllToAll>>({}, batch, shape, topo);
    std::erase_if(u.forward[1].steps,
                  [](const comm::Step& s) { return std::holds_alternative<comm::ExchangeStep>(s); });
    const replay::Replay stuck(u.forward, topo, shape, opt);
    CHECK_THROWS_WITH_AS((void)stuck.run(), doctest::Contains("deadlock"), std::logic_error);
    CHECK(invalid_message([&] { (void)replay::profiles::by_name("tpu-v9"); }).find("tpu-v9") != std::string::npos);
    auto split = opt;
    split.hardware.nvlink_domain = 4;  // NVLink domains without a link between them
    CHECK(invalid_message([&] {
            (void)replay::Replay(c.forward, topo, shape, split);
          }).find("host.bandwidth = 0: must be > 0 when nvlink_domain = 4") != std::string::npos);
    split.hardware.nvlink_domain = -1;
    CHECK(invalid_message([&] {
            (void)replay::Replay(c.forward, topo, shape, split);
          }).find("nvlink_domain = -1: must be >= 0") != std::string::npos);
  }
}
