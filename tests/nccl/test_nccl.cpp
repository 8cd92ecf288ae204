// SPDX-License-Identifier: Apache-2.0
// The NCCL transport on every GPU of the machine: one process per GPU, every rank running every case
// in the same order (tests/nccl/main.cpp makes the world: one rank plain, P ranks under mpirun).
//  - the transport-generic cases (tests/support/transport_cases.hpp) on host buffers, which the
//    transport stages through device memory and completes on the host;
//  - device buffers, stream-ordered on the caller's queue and read back through event ordering;
//  - every TransportStrategies strategy with CudaFlash<float> on device buffers, against the fp64
//    reference (1e-4 of the largest reference value) with the counted bytes equal to the declared;
//  - failures: a communicator whose other ranks never join times out and is aborted (one GPU is
//    enough), an aborted transport refuses every operation, and on 2+ ranks a barrier and a
//    stream-ordered receive that a peer never enters time out naming the operation, level and peer.
// Not applicable here: protocol_case (NCCL cannot tell a receive of the wrong size: undefined there,
// not Errc::kProtocol) and, on one rank, bad_arguments_case (every size is a multiple of 1).
#include <doctest/doctest.h>

#include <seqpar/backend/nccl.hpp>
#include <seqpar/seqpar.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <numeric>
#include <random>
#include <span>
#include <string>
#include <thread>
#include <tuple>
#include <type_traits>
#include <vector>

#include "nccl/world.hpp"
#include "seqpar/gpu/check.hpp"
#include "seqpar/gpu/data_ops.hpp"
#include "seqpar/gpu/device_memory.hpp"
#include "seqpar/gpu/exec.hpp"
#include "seqpar/gpu/flash.hpp"
#include "support/transport_cases.hpp"

using namespace std::chrono_literals;

namespace seqpar {
namespace {

using NcclTransport = backend::nccl::Transport;

void report(const test::Failures& f) {
  for (const auto& m : f.messages()) FAIL_CHECK(m);
}

bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

// Device bytes holding `host` (synchronous).
gpu::DeviceArray<std::byte> on_device(const std::vector<std::byte>& host) {
  return gpu::DeviceArray<std::byte>(host);
}

// Device bytes all 0xee, so that what a transfer does not write shows.
gpu::DeviceArray<std::byte> poisoned(std::size_t n) {
  gpu::DeviceArray<std::byte> d(n);
  if (n != 0) SEQPAR_CUDA_CHECK(cudaMemset(d.data(), 0xee, n), "test poison");
  return d;
}

// Runs `call`, which must throw seqpar::Error; returns it (or a default with kStepFailed if not).
template <class F>
Error error_of(F&& call) {
  try {
    call();
  } catch (const Error& e) {
    return e;
  }
  FAIL_CHECK("no seqpar::Error was thrown");
  return Error(Errc::kStepFailed, "nothing thrown");
}

// ---- strategies on device buffers --------------------------------------------------------------------

// Runs strategy S with CudaFlash<float> over `t` on `batch`: every rank computes the fp64 reference over
// the whole batch (same seed on every rank), runs forward and backward on its shard in device memory,
// and compares its shard of O, LSE, dQ, dK, dV (1e-4 of the largest reference value: fp32 storage and
// accumulation) and its counted bytes with the program's. False when the strategy refuses the batch.
template <class S>
bool device_strategy_case(NcclTransport& t, test::Failures& f, const std::string& name, const DocumentBatch& batch,
                          const AttentionShape& shape, typename S::Arguments args) {
  constexpr double kTolerance = 1e-4;
  const int me = t.rank();
  const Topology topo{t.size(), args.ranks_per_node == 0 ? t.size() : args.ranks_per_node};
  if (!S::can_implement(args, batch, shape, topo)) return false;
  const std::int64_t n = batch.total_tokens();
  const int d = shape.head_dim;
  std::mt19937 rng(11);
  std::normal_distribution<double> normal(0.0, 1.0);
  ThdTensor<double> q(n, shape.heads_q, d), k(n, shape.heads_kv, d), v(n, shape.heads_kv, d), dout(n, shape.heads_q, d),
      o(n, shape.heads_q, d), dq(n, shape.heads_q, d), dk(n, shape.heads_kv, d), dv(n, shape.heads_kv, d);
  LseTensor<double> lse(shape.heads_q, n);
  for (auto* x : {&q, &k, &v, &dout})
    for (double& e : x->storage) e = static_cast<double>(static_cast<float>(normal(rng)));  // exact in fp32
  const attention::Reference<double> ref;
  const auto slices = batch.document_causal_slices();
  ref.forward(shape, q.view(), k.view(), v.view(), slices, o.view(), lse.view());
  ref.backward(shape, q.view(), k.view(), v.view(), o.view(), lse.view(), dout.view(), slices, dq.view(), dk.view(),
               dv.view());

  const gpu::CudaExec exec(t.device());
  DistributedAttention<S, attention::CudaFlash<float>> attn(t, shape, args, attention::CudaFlash<float>(exec));
  const auto& owned = attn.owned_ranges(batch);
  const std::int64_t local = attn.local_tokens(batch);
  const auto shard = [&](const ThdTensor<double>& g) {  // (local, heads, d) in fp32, plan order
    std::vector<float> l(static_cast<std::size_t>(local * g.heads * d));
    std::size_t at = 0;
    for (const Range& r : owned)
      for (std::int64_t tok = r.begin; tok < r.end; ++tok)
        for (int h = 0; h < g.heads; ++h)
          for (int x = 0; x < d; ++x) l[at++] = static_cast<float>(g.view()(tok, h, x));
    return l;
  };
  const gpu::DeviceArray<float> lq(shard(q)), lk(shard(k)), lv(shard(v)), ldo(shard(dout));
  const auto rows_q = static_cast<std::size_t>(local * shape.heads_q * d);
  const auto rows_kv = static_cast<std::size_t>(local * shape.heads_kv * d);
  gpu::DeviceArray<float> lo(rows_q), ldq(rows_q), ldk(rows_kv), ldv(rows_kv),
      llse(static_cast<std::size_t>(local * shape.heads_q));
  const auto view = [&](const gpu::DeviceArray<float>& a, int heads) {
    return ThdView<float>::dense(a.data(), local, heads, d);
  };
  attn.forward(batch, view(lq, shape.heads_q), view(lk, shape.heads_kv), view(lv, shape.heads_kv),
               view(lo, shape.heads_q), LseView<float>::dense(llse.data(), shape.heads_q, local));
  const auto& prog = attn.program(batch);
  f.expect(
      attn.last_bytes_sent() == prog.forward.bytes_sent(sizeof(float), sizeof(float)),
      test::cases::at(me, name + ": forward bytes counted " + std::to_string(attn.last_bytes_sent()) + " != declared " +
                              std::to_string(prog.forward.bytes_sent(sizeof(float), sizeof(float)))));
  attn.backward(batch, view(lq, shape.heads_q), view(lk, shape.heads_kv), view(lv, shape.heads_kv),
                view(lo, shape.heads_q), LseView<const float>::dense(llse.data(), shape.heads_q, local),
                view(ldo, shape.heads_q), view(ldq, shape.heads_q), view(ldk, shape.heads_kv),
                view(ldv, shape.heads_kv));
  f.expect(attn.last_bytes_sent() == prog.backward.bytes_sent(sizeof(float), sizeof(float)),
           test::cases::at(me, name + ": backward bytes counted != declared"));
  exec.synchronize();

  const auto rel = [&](const ThdTensor<double>& want, const gpu::DeviceArray<float>& got_d) {
    const std::vector<float> got = got_d.to_host();
    const std::vector<float> w = shard(want);
    double scale = 0, err = 0;
    for (std::size_t i = 0; i < w.size(); ++i) {
      scale = std::max(scale, std::abs(double(w[i])));
      err = std::max(err, std::isfinite(got[i]) ? std::abs(double(w[i]) - double(got[i])) : INFINITY);
    }
    return scale > 0 ? err / scale : err;
  };
  const std::vector<float> got_lse = llse.to_host();
  double lse_err = 0;
  std::int64_t row = 0;
  for (const Range& r : owned)
    for (std::int64_t tok = r.begin; tok < r.end; ++tok, ++row)
      for (int h = 0; h < shape.heads_q; ++h) {
        const double want = lse.view()(h, tok), got = got_lse[static_cast<std::size_t>(h * local + row)];
        lse_err =
            std::max(lse_err, std::isfinite(got) ? std::abs(want - got) / std::max(1.0, std::abs(want)) : INFINITY);
      }
  const double errs[5] = {rel(o, lo), lse_err, rel(dq, ldq), rel(dk, ldk), rel(dv, ldv)};
  const char* names[5] = {"O", "LSE", "dQ", "dK", "dV"};
  for (int i = 0; i < 5; ++i)
    f.expect(errs[i] < kTolerance, test::cases::at(me, name + ": " + names[i] + " error " + std::to_string(errs[i])));
  return true;
}

}  // namespace

TEST_SUITE("nccl") {
  TEST_CASE("nccl: transport cases on host buffers (staged through the device)") {
    NcclTransport& t = test::nccl_world();
    INFO("world size " << t.size());
    test::Failures f;
    test::point_to_point_case(t, f);
    test::ring_case(t, f);
    test::all_to_all_case(t, f);
    test::all_to_all_v_case(t, f);
    test::all_gather_case(t, f);
    test::split_case(t, f);
    if (t.size() >= 2) test::bad_arguments_case(t, f);
    report(f);
  }

  TEST_CASE("nccl: device buffers are stream-ordered on the caller's queue") {
    NcclTransport& t = test::nccl_world();
    const int n = t.size(), me = t.rank();
    const auto un = static_cast<std::size_t>(n);
    const gpu::CudaExec exec(t.device());
    t.set_queue(exec.comm_queue());
    CHECK(t.queue() == exec.comm_stream());
    const TrafficCounters before = t.counters();
    std::vector<std::uint64_t> to_peer(un, 0);
    std::uint64_t messages = 0;

    // all_to_all_v with hash-chosen sizes (some zero).
    std::vector<std::size_t> sc(un), rc(un);
    std::vector<std::byte> s_host;
    for (int p = 0; p < n; ++p) {
      sc[std::size_t(p)] = test::cases::v_bytes(me, p, n, 7);
      rc[std::size_t(p)] = test::cases::v_bytes(p, me, n, 7);
      const auto b = test::cases::payload(me, p, sc[std::size_t(p)], 7);
      s_host.insert(s_host.end(), b.begin(), b.end());
      if (p != me && sc[std::size_t(p)] != 0) to_peer[std::size_t(p)] += sc[std::size_t(p)], ++messages;
    }
    const auto a2a_s = on_device(s_host);
    auto a2a_r = poisoned(std::accumulate(rc.begin(), rc.end(), std::size_t{0}));
    // A ring step of 1 MiB (the large-message path of NCCL's p2p).
    const std::size_t ring_bytes = std::size_t{1} << 20;
    const int next = (me + 1) % n, prev = (me + n - 1) % n;
    const auto ring_s = on_device(test::cases::payload(me, next, ring_bytes, 8));
    auto ring_r = poisoned(ring_bytes);
    if (next != me) to_peer[std::size_t(next)] += ring_bytes, ++messages;
    // all_gather of 4 KiB + 8 bytes and all_gather_v with one empty rank.
    const std::size_t ag_bytes = 4104;
    const auto ag_s = on_device(test::cases::payload(me, -1, ag_bytes, 9));
    auto ag_r = poisoned(ag_bytes * un);
    std::vector<std::size_t> counts(un);
    for (int i = 0; i < n; ++i) counts[std::size_t(i)] = i == n - 1 && n > 1 ? 0 : 24 * std::size_t(i + 1);
    const auto agv_s = on_device(test::cases::payload(me, -2, counts[std::size_t(me)], 10));
    auto agv_r = poisoned(std::accumulate(counts.begin(), counts.end(), std::size_t{0}));
    for (int p = 0; p < n; ++p)
      if (p != me) {
        to_peer[std::size_t(p)] += ag_bytes + counts[std::size_t(me)];
        messages += 1 + (counts[std::size_t(me)] != 0 ? 1 : 0);
      }

    t.all_to_all_v(a2a_s.span(), sc, a2a_r.span(), rc);
    auto r = t.irecv(ring_r.span(), prev, 3);
    auto s = t.isend(ring_s.span(), next, 3);
    t.wait(r);  // enqueued: returns at once
    t.wait(s);
    CHECK_FALSE(r.pending());
    t.all_gather(ag_s.span(), ag_r.span());
    t.all_gather_v(agv_s.span(), agv_r.span(), counts);
    // Read back on the compute stream, ordered after the transfers by an event (as the executor does).
    exec.compute_after_comm();
    std::vector<std::byte> a2a(a2a_r.size()), ring(ring_bytes), ag(ag_r.size()), agv(agv_r.size());
    const auto back = [&](std::vector<std::byte>& h, const gpu::DeviceArray<std::byte>& dv) {
      if (!h.empty())
        SEQPAR_CUDA_CHECK(cudaMemcpyAsync(h.data(), dv.data(), h.size(), cudaMemcpyDeviceToHost, exec.stream()),
                          "test");
    };
    back(a2a, a2a_r), back(ring, ring_r), back(ag, ag_r), back(agv, agv_r);
    t.synchronize();  // the transfers, under the deadline
    exec.synchronize();

    std::size_t at = 0;
    for (int p = 0; p < n; ++p) {
      CHECK_MESSAGE(test::cases::holds(std::span<const std::byte>(a2a).subspan(at, rc[std::size_t(p)]), p, me, 7),
                    "all_to_all_v from rank " << p);
      at += rc[std::size_t(p)];
    }
    CHECK_MESSAGE(test::cases::holds(ring, prev, me, 8), "ring step from rank " << prev);
    for (int p = 0; p < n; ++p)
      CHECK_MESSAGE(
          test::cases::holds(std::span<const std::byte>(ag).subspan(std::size_t(p) * ag_bytes, ag_bytes), p, -1, 9),
          "all_gather from rank " << p);
    at = 0;
    for (int p = 0; p < n; ++p) {
      CHECK_MESSAGE(test::cases::holds(std::span<const std::byte>(agv).subspan(at, counts[std::size_t(p)]), p, -2, 10),
                    "all_gather_v from rank " << p);
      at += counts[std::size_t(p)];
    }
    test::Failures f;
    test::cases::expect_traffic(f, t, before, to_peer, messages, "device buffers");
    report(f);
    t.set_queue(nullptr);  // back to the transport's own stream
    t.barrier();
  }

  TEST_CASE("nccl: strategies against the fp64 reference (CudaFlash<float>, device buffers)") {
    NcclTransport& t = test::nccl_world();
    INFO("world size " << t.size());
    const AttentionShape shape{8, 4, 64};  // GQA 8:4; CudaFlash takes head_dim 64 or 128
    const DocumentBatch one = test::small_batch(1, 2026), three = test::small_batch(3, 99);
    test::Failures f;
    int accepted = 0;
    test::for_each_type<test::TransportStrategies>([&]<class C>(std::type_identity<C>) {
      typename C::strategy::Arguments args = C::arguments();
      args.ranks_per_node = C::ranks_per_node;
      accepted += device_strategy_case<typename C::strategy>(
          t, f, C::name(), C::batch == test::CaseBatch::kOneSequence ? one : three, shape, args);
    });
    MESSAGE(accepted << " of " << test::kNumTransportStrategies << " strategies ran on " << t.size() << " rank(s)");
    CHECK(accepted >= 1);
    if (t.size() >= 2) CHECK(accepted == test::kNumTransportStrategies);
    report(f);
  }

  TEST_CASE("nccl: bad arguments throw std::invalid_argument before communicating") {
    NcclTransport& t = test::nccl_world();
    const int n = t.size();
    std::vector<std::byte> b(8);
    CHECK_THROWS_AS(t.send(b, n, 0), std::invalid_argument);
    CHECK_THROWS_AS((void)t.irecv(b, 0, -1), std::invalid_argument);
    CHECK_THROWS_AS((void)t.split(-1, 0), std::invalid_argument);
    CHECK_THROWS_AS(t.set_timeout(0ms), std::invalid_argument);
    std::vector<std::size_t> counts(static_cast<std::size_t>(n) + 1, 0);
    CHECK_THROWS_AS(t.all_to_all_v(b, counts, b, counts), std::invalid_argument);
    std::vector<std::byte> r(8 * static_cast<std::size_t>(n));
    CHECK_THROWS_AS(t.all_gather(std::span<const std::byte>(r), std::span<std::byte>(r)), std::invalid_argument);
    // A request of another transport.
    NcclTransport other = t.split(0, t.rank());
    auto req = other.irecv(std::span<std::byte>(), t.rank(), 1);
    CHECK_THROWS_AS(t.wait(req), std::invalid_argument);
    other.wait(req);
    CHECK_FALSE(req.pending());
    t.barrier();  // nothing above communicated (but the split): every rank still meets here
  }

  TEST_CASE("nccl: an aborted transport refuses every operation, naming why") {
    NcclTransport& t = test::nccl_world();
    NcclTransport c = t.split(0, t.rank());
    c.barrier();
    c.abort();
    CHECK(c.aborted());
    CHECK(c.comm() == nullptr);
    CHECK(c.rank() == t.rank());
    CHECK(c.size() == t.size());
    std::vector<std::byte> b(8), r(8 * static_cast<std::size_t>(t.size()));
    for (const Error& e : {error_of([&] { c.barrier(); }),
                           error_of([&] { c.all_gather(std::span<const std::byte>(b), std::span<std::byte>(r)); }),
                           error_of([&] { (void)c.isend(b, t.rank(), 0); }), error_of([&] { c.synchronize(); })}) {
      INFO(e.what());
      CHECK(e.errc() == Errc::kTransport);
      CHECK(contains(e.what(), "aborted earlier"));
      CHECK(contains(e.what(), "world/0"));
    }
    t.barrier();  // the world is another communicator: unaffected
  }

  TEST_CASE("nccl: a barrier a peer never enters times out naming rank, level and operation") {
    NcclTransport& t = test::nccl_world();
    if (t.size() < 2) {
      MESSAGE("needs 2 ranks (mpirun): on one GPU the deadline and abort are the creation case above");
      return;
    }
    NcclTransport c = t.split(1, t.rank());
    c.set_timeout(500ms);
    if (t.rank() == 0) {
      const auto start = std::chrono::steady_clock::now();
      const Error e = error_of([&] { c.barrier(); });
      const auto took = std::chrono::steady_clock::now() - start;
      INFO(e.what());
      CHECK(e.errc() == Errc::kTimeout);
      CHECK(took >= 500ms);
      CHECK(took < 10s);
      CHECK(contains(e.what(), "rank 0 of world/1"));
      CHECK(contains(e.what(), "barrier"));
      CHECK(contains(e.what(), "500 ms"));
      CHECK(c.aborted());
    }
    t.barrier();  // the others idle until rank 0 timed out, then drop their end
    if (t.rank() != 0) c.abort();
    t.barrier();
  }

  TEST_CASE("nccl: a stream-ordered receive a peer never sends is caught at the next call") {
    NcclTransport& t = test::nccl_world();
    if (t.size() < 2) {
      MESSAGE("needs 2 ranks (mpirun)");
      return;
    }
    NcclTransport c = t.split(2, t.rank());
    c.set_timeout(500ms);
    if (t.rank() == 0) {
      auto buf = poisoned(64);
      auto r = c.irecv(buf.span(), 1, 7);
      const Error e = error_of([&] {
        c.wait(r);  // enqueues (or times out enqueueing, if NCCL connects to rank 1 first)
        std::this_thread::sleep_for(700ms);
        c.synchronize();
      });
      INFO(e.what());
      CHECK(e.errc() == Errc::kTimeout);
      CHECK(contains(e.what(), "rank 0 of world/2"));
      CHECK(contains(e.what(), "isend/irecv with rank 1"));
      CHECK(c.aborted());
    }
    t.barrier();
    if (t.rank() != 0) c.abort();
    t.barrier();
  }

  TEST_CASE("nccl: a world of one rank through a file store") {
    NcclTransport& t = test::nccl_world();
    const auto path = std::filesystem::temp_directory_path() /
                      ("seqpar_nccl_test_" + std::to_string(t.world_rank()) + "_" +
                       std::to_string(std::chrono::steady_clock::now().time_since_epoch().count()));
    backend::nccl::FileStore store(path, 10s);
    NcclTransport one = NcclTransport::bootstrap(store, 0, 1, {.timeout = 30s, .device = t.device()});
    CHECK(one.size() == 1);
    CHECK_FALSE(std::filesystem::exists(path));  // removed once every rank joined
    std::vector<std::byte> s = test::cases::payload(0, 0, 100, 3), r(100);
    one.all_gather(std::span<const std::byte>(s), std::span<std::byte>(r));
    CHECK(r == s);
    t.barrier();
  }

  // Last: if aborting a communicator that is still being created ever hung, the other cases have run.
  TEST_CASE("nccl: a communicator whose other ranks never join times out and is aborted") {
    NcclTransport& t = test::nccl_world();
    if (t.rank() == 0) {
      const auto start = std::chrono::steady_clock::now();
      const Error e = error_of(
          [&] { NcclTransport lonely(backend::nccl::unique_id(), 0, 2, {.timeout = 1s, .device = t.device()}); });
      const auto took = std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - start);
      MESSAGE("timed out and aborted in " << took.count() << " ms: " << e.what());
      CHECK(e.errc() == Errc::kTimeout);
      CHECK(took >= 1s);
      CHECK(took < 60s);
      CHECK(contains(e.what(), "rank 0 of world"));
      CHECK(contains(e.what(), "did not join"));
      CHECK(contains(e.what(), "1000 ms"));
      CHECK(contains(e.what(), "aborted"));
    }
    t.barrier();
  }
}

}  // namespace seqpar
