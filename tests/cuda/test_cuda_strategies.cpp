// SPDX-License-Identifier: Apache-2.0
// The CUDA runtime end to end on one GPU:
//  - the executor's data ops on the device (runtime::DataOps<gpu::CudaExec>) against the host's
//    (DataOps<HostExec>) on random piece tables, strided views, misaligned pieces, overlapping
//    accumulations and merges with empty rows;
//  - the device world (cuda/device_world.hpp): the transport-generic cases, and device buffers;
//  - every partitioner x communicator combination (tests/support/strategy_list.hpp) on 1, 2, 3, 4 and
//    8 ranks sharing the GPU (one host thread, one CudaExec and one CudaFlash<float> each), forward
//    and backward against the fp64 reference on the whole batch (fp32: 1e-4 of the largest reference
//    value, as the CPU tests measure), and a bf16 subset at TransformerEngine's 2.5e-2.
#include <doctest/doctest.h>

#include <seqpar/seqpar.hpp>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <mutex>
#include <random>
#include <span>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "cuda/device_storage.hpp"
#include "seqpar/gpu/check.hpp"
#include "seqpar/gpu/data_ops.hpp"
#include "seqpar/gpu/device_memory.hpp"
#include "seqpar/gpu/device_world.hpp"
#include "seqpar/gpu/exec.hpp"
#include "seqpar/gpu/flash.hpp"
#include "support/distributed_check.hpp"
#include "support/strategy_list.hpp"
#include "support/transport_cases.hpp"

namespace seqpar {
namespace {

// ---- host <-> device helpers -------------------------------------------------------------------------

template <class T>
T to_storage(double x) {
  return gpu::detail::from_float<T>(static_cast<float>(x));
}

template <class T>
double to_double(T x) {
  return static_cast<double>(gpu::detail::to_float(x));
}

// A device copy of `host`, issued on `exec`'s stream (the caller synchronizes before `host` goes).
template <class T>
gpu::DeviceArray<T> upload(const std::vector<T>& host, const gpu::CudaExec& exec) {
  gpu::DeviceArray<T> d(host.size());
  if (!host.empty())
    SEQPAR_CUDA_CHECK(
        cudaMemcpyAsync(d.data(), host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice, exec.stream()),
        "test upload");
  return d;
}

// ---- DataOps<CudaExec> against DataOps<HostExec> ----------------------------------------------------

using runtime::BufferId;
using runtime::PieceCopy;

// One buffer of the data-ops test, on the host and on the device with the same layout: a THD view of
// `heads` heads out of `parent_heads` (a strided heads slice when they differ) with `pad` spare
// elements per token, or an LSE view with `pad` spare tokens per head.
template <class T>
struct TestBuffer {
  std::vector<T> host;
  gpu::DeviceArray<T> device;
  std::int64_t tokens = 0;
  int heads = 0, parent_heads = 0, first_head = 0, head_dim = 0;
  std::int64_t pad = 0;
  bool lse = false;

  [[nodiscard]] std::int64_t token_stride() const { return std::int64_t{parent_heads} * head_dim + pad; }
  [[nodiscard]] ThdView<T> thd(T* base) const {
    return {base + std::int64_t{first_head} * head_dim, tokens, heads, head_dim, token_stride(), head_dim};
  }
  [[nodiscard]] LseView<T> lse_view(T* base) const { return {base, heads, tokens, tokens + pad}; }
  [[nodiscard]] std::size_t elements() const {
    return lse ? static_cast<std::size_t>(heads * (tokens + pad)) : static_cast<std::size_t>(tokens * token_stride());
  }
};

template <class T>
TestBuffer<T> make_buffer(std::int64_t tokens, int heads, int parent_heads, int first_head, int head_dim,
                          std::int64_t pad, bool lse, std::mt19937& rng, const gpu::CudaExec& exec) {
  TestBuffer<T> b;
  b.tokens = tokens, b.heads = heads, b.parent_heads = parent_heads, b.first_head = first_head;
  b.head_dim = head_dim, b.pad = pad, b.lse = lse;
  std::normal_distribution<double> normal(0.0, 1.0);
  b.host.resize(b.elements());
  for (T& x : b.host) x = to_storage<T>(normal(rng));
  b.device = upload(b.host, exec);
  return b;
}

// Random boxes of `buffer` (rows, heads), each `count` pieces, back to back from `offset`.
std::uint64_t add_pieces(std::vector<PieceCopy>& out, BufferId id, std::int64_t tokens, int heads, int count,
                         bool accumulate, std::uint64_t offset, std::size_t element_bytes, int head_dim,
                         std::mt19937& rng, bool disjoint_rows) {
  std::int64_t next_row = 0;
  for (int i = 0; i < count; ++i) {
    Range rows, hs;
    if (disjoint_rows) {
      const std::int64_t left = tokens - next_row;
      if (left <= 0) break;
      const std::int64_t len =
          1 + static_cast<std::int64_t>(rng() % static_cast<std::uint32_t>(std::min<std::int64_t>(left, 9)));
      rows = {next_row, next_row + len};
      next_row += len + static_cast<std::int64_t>(rng() % 2);
    } else {
      const std::int64_t a = static_cast<std::int64_t>(rng() % static_cast<std::uint32_t>(tokens));
      const std::int64_t len = 1 + static_cast<std::int64_t>(rng() % static_cast<std::uint32_t>(tokens - a));
      rows = {a, a + len};
    }
    const int h0 = static_cast<int>(rng() % static_cast<std::uint32_t>(heads));
    const int hn = 1 + static_cast<int>(rng() % static_cast<std::uint32_t>(heads - h0));
    hs = {h0, h0 + hn};
    out.push_back({id, accumulate, rows, hs, offset});
    const bool lse = comm::is_lse(id);
    offset += static_cast<std::uint64_t>(rows.size() * hs.size() * (lse ? 1 : head_dim)) * element_bytes;
  }
  return offset;
}

template <class T>
void check_data_ops(int head_dim, std::uint32_t seed) {
  using A = float;
  using Host = runtime::DataOps<HostExec>;
  using Device = runtime::DataOps<gpu::CudaExec>;
  INFO("T size " << sizeof(T) << ", head_dim " << head_dim << ", seed " << seed);
  gpu::CudaExec exec(0);
  const HostExec host_exec;
  std::mt19937 rng(seed);
  const std::int64_t n = 37;
  // kQ dense; kK a strided heads slice with padding; kDk dense (accumulated into); kLse padded.
  auto q = make_buffer<T>(n, 4, 4, 0, head_dim, 0, false, rng, exec);
  auto k = make_buffer<T>(n, 3, 6, 2, head_dim, 8, false, rng, exec);
  auto dk = make_buffer<T>(n, 3, 3, 0, head_dim, 0, false, rng, exec);
  auto lse = make_buffer<A>(n, 4, 4, 0, 0, 5, true, rng, exec);
  SEQPAR_CUDA_CHECK(cudaStreamSynchronize(exec.stream()), "test");

  const auto tables = [&](T* qb, T* kb, T* dkb, A* lseb) {
    runtime::BufferTable<T, A> b;
    b.thd[static_cast<std::size_t>(BufferId::kQ)] = q.thd(qb);
    b.thd[static_cast<std::size_t>(BufferId::kK)] = k.thd(kb);
    b.thd[static_cast<std::size_t>(BufferId::kDk)] = dk.thd(dkb);
    b.lse[static_cast<std::size_t>(BufferId::kLse)] = lse.lse_view(lseb);
    return b;
  };
  const auto host_table = [&] { return tables(q.host.data(), k.host.data(), dk.host.data(), lse.host.data()); };
  const auto device_table = [&] {
    return tables(q.device.data(), k.device.data(), dk.device.data(), lse.device.data());
  };
  const auto expect_same = [&](const char* what) {
    SEQPAR_CUDA_CHECK(cudaStreamSynchronize(exec.stream()), "test");
    const auto same = [&](auto& buffer, const char* name) {
      const auto got = buffer.device.to_host();
      CHECK_MESSAGE(std::memcmp(got.data(), buffer.host.data(), got.size() * sizeof(got[0])) == 0,
                    what << ": buffer " << name << " differs from the host's");
    };
    same(q, "q"), same(k, "k"), same(dk, "dk"), same(lse, "lse");
  };

  // Pack: pieces of q, k, lse (odd LSE pieces misalign the THD pieces after them).
  runtime::LoweredProgram lp;
  lp.head_dim = head_dim;
  std::uint64_t off = 0;
  off = add_pieces(lp.copies, BufferId::kQ, n, 4, 3, false, off, sizeof(T), head_dim, rng, false);
  off = add_pieces(lp.copies, BufferId::kLse, n, 4, 2, false, off, sizeof(A), head_dim, rng, false);
  off = add_pieces(lp.copies, BufferId::kK, n, 3, 3, false, off, sizeof(T), head_dim, rng, false);
  off = add_pieces(lp.copies, BufferId::kLse, n, 4, 1, false, off, sizeof(A), head_dim, rng, false);
  off = add_pieces(lp.copies, BufferId::kDk, n, 3, 2, false, off, sizeof(T), head_dim, rng, false);
  const std::uint32_t pack_count = static_cast<std::uint32_t>(lp.copies.size());
  const std::uint64_t pack_bytes = off;
  // Unpack: disjoint rows of q and k, then three "peers" adding to overlapping rows of dk, then lse.
  std::uint64_t uoff = 0;
  uoff = add_pieces(lp.copies, BufferId::kQ, n, 4, 6, false, uoff, sizeof(T), head_dim, rng, true);
  uoff = add_pieces(lp.copies, BufferId::kK, n, 3, 6, false, uoff, sizeof(T), head_dim, rng, true);
  for (int peer = 0; peer < 3; ++peer)
    uoff = add_pieces(lp.copies, BufferId::kDk, n, 3, 2, true, uoff, sizeof(T), head_dim, rng, false);
  uoff = add_pieces(lp.copies, BufferId::kLse, n, 4, 3, true, uoff, sizeof(A), head_dim, rng, false);
  const std::uint32_t unpack_count = static_cast<std::uint32_t>(lp.copies.size()) - pack_count;
  runtime::ExchangeOp ex;
  ex.pack = {0, pack_count};
  ex.unpack = {pack_count, unpack_count};
  lp.ops.push_back({ex, {}, 0, "exchange"});
  // Merge slices: disjoint query ranges with gaps, listed out of order (upload sorts the device copy).
  lp.slices = {AttnSlice{{20, 30}, {0, 1}, {}}, AttnSlice{{0, 7}, {0, 1}, {}}, AttnSlice{{9, 10}, {0, 1}, {}},
               AttnSlice{{31, 37}, {0, 1}, {}}};
  runtime::MergeOp mop;
  mop.slices = {0, static_cast<std::uint32_t>(lp.slices.size())};
  lp.ops.push_back({mop, {}, 0, "merge"});
  const Device::Tables t = Device::upload(exec, lp);
  const runtime::TableSlice<PieceCopy> pack_host{{lp.copies.data(), pack_count}, lp.copies.data()};
  const runtime::TableSlice<PieceCopy> pack_dev{{lp.copies.data(), pack_count}, t.copies};
  const runtime::TableSlice<PieceCopy> unpack_host{{lp.copies.data() + pack_count, unpack_count},
                                                   lp.copies.data() + pack_count};
  const runtime::TableSlice<PieceCopy> unpack_dev{{lp.copies.data() + pack_count, unpack_count}, t.copies + pack_count};

  {  // pack: the same bytes
    std::vector<std::byte> want(pack_bytes);
    gpu::DeviceBytes region(pack_bytes + 64);
    Host::pack(host_exec, host_table(), pack_host, want.data(), comm::HeadWidths{head_dim, head_dim});
    Device::pack(exec, device_table(), pack_dev, region.data() + 16,
                 comm::HeadWidths{head_dim, head_dim});  // region 16-byte aligned
    SEQPAR_CUDA_CHECK(cudaStreamSynchronize(exec.stream()), "test");
    std::vector<std::byte> got(pack_bytes);
    SEQPAR_CUDA_CHECK(cudaMemcpy(got.data(), region.data() + 16, pack_bytes, cudaMemcpyDeviceToHost), "test");
    CHECK_MESSAGE(got == want, "pack: the message differs from the host's");
    // A region at an odd address: every window is misaligned.
    Device::pack(exec, device_table(), pack_dev, region.data() + 3, comm::HeadWidths{head_dim, head_dim});
    SEQPAR_CUDA_CHECK(cudaStreamSynchronize(exec.stream()), "test");
    SEQPAR_CUDA_CHECK(cudaMemcpy(got.data(), region.data() + 3, pack_bytes, cudaMemcpyDeviceToHost), "test");
    CHECK_MESSAGE(got == want, "pack into a misaligned region: the message differs from the host's");
  }
  {  // unpack (assignments and ordered accumulations): the same buffers, bit for bit
    std::vector<std::byte> message(uoff);
    std::normal_distribution<double> normal(0.0, 1.0);
    for (const PieceCopy& c : unpack_host.host) {
      const bool is_lse = comm::is_lse(c.buffer);
      const std::size_t elems = static_cast<std::size_t>(c.rows.size() * c.heads.size() * (is_lse ? 1 : head_dim));
      for (std::size_t e = 0; e < elems; ++e) {
        if (is_lse) {
          const A x = static_cast<A>(normal(rng));
          std::memcpy(message.data() + c.offset + e * sizeof(A), &x, sizeof(A));
        } else {
          const T x = to_storage<T>(normal(rng));
          std::memcpy(message.data() + c.offset + e * sizeof(T), &x, sizeof(T));
        }
      }
    }
    gpu::DeviceBytes region(uoff + 64);
    SEQPAR_CUDA_CHECK(cudaMemcpy(region.data(), message.data(), uoff, cudaMemcpyHostToDevice), "test");
    SEQPAR_CUDA_CHECK(cudaDeviceSynchronize(), "test");  // pageable copies may finish after cudaMemcpy returns
    Host::unpack(host_exec, host_table(), unpack_host, message.data(), comm::HeadWidths{head_dim, head_dim});
    Device::unpack(exec, device_table(), unpack_dev, region.data(), comm::HeadWidths{head_dim, head_dim});
    expect_same("unpack");
  }
  {  // zero a strided view and an LSE view; fill_empty the same
    const std::array<BufferId, 2> ids{BufferId::kK, BufferId::kLse};
    Host::zero(host_exec, host_table(), std::span<const BufferId>(ids));
    Device::zero(exec, device_table(), std::span<const BufferId>(ids));
    expect_same("zero");
    Host::fill_empty(host_exec, q.thd(q.host.data()).heads_slice(1, 2),
                     lse.lse_view(lse.host.data()).heads_slice(1, 2));
    Device::fill_empty(exec, q.thd(q.device.data()).heads_slice(1, 2),
                       lse.lse_view(lse.device.data()).heads_slice(1, 2));
    expect_same("fill_empty");
  }
  {  // merge: o = the strided k rows, part = dk; LSEs random with -inf on either side
    auto lse_part = make_buffer<A>(n, 3, 3, 0, 0, 0, true, rng, exec);
    auto lse_o = make_buffer<A>(n, 3, 3, 0, 0, 2, true, rng, exec);
    for (auto* b : {&lse_part, &lse_o})
      for (std::size_t i = 0; i < b->host.size(); ++i)
        if (rng() % 4 == 0) b->host[i] = -std::numeric_limits<A>::infinity();
    lse_part.device = upload(lse_part.host, exec);
    lse_o.device = upload(lse_o.host, exec);
    SEQPAR_CUDA_CHECK(cudaStreamSynchronize(exec.stream()), "test");
    const runtime::TableSlice<AttnSlice> sh{lp.slices, lp.slices.data()};
    const runtime::TableSlice<AttnSlice> sd{lp.slices, t.slices};
    Host::merge(host_exec, k.thd(k.host.data()), lse_o.lse_view(lse_o.host.data()), dk.thd(dk.host.data()),
                lse_part.lse_view(lse_part.host.data()), sh);
    Device::merge(exec, k.thd(k.device.data()), lse_o.lse_view(lse_o.device.data()), dk.thd(dk.device.data()),
                  lse_part.lse_view(lse_part.device.data()), sd);
    SEQPAR_CUDA_CHECK(cudaStreamSynchronize(exec.stream()), "test");
    // expf and log1pf differ from the host's by an ulp or two; T rounds once after that.
    const double tol = std::is_same_v<T, float> ? 1e-5 : 1e-2;
    const auto close = [&](const auto& got, const auto& want, const char* name) {
      std::size_t bad = 0;
      for (std::size_t i = 0; i < want.size(); ++i) {
        const double g = to_double(got[i]), w = to_double(want[i]);
        if (std::isinf(w) || std::isinf(g) ? g != w : !(std::abs(g - w) <= tol * (1 + std::abs(w)))) ++bad;
      }
      CHECK_MESSAGE(bad == 0, "merge: " << bad << " elements of " << name << " differ from the host's");
    };
    close(k.device.to_host(), k.host, "o");
    close(lse_o.device.to_host(), lse_o.host, "lse");
  }
  {  // pieces out of offset order are refused where they reach the device
    runtime::LoweredProgram bad = lp;
    std::swap(bad.copies[0], bad.copies[1]);
    CHECK_THROWS_AS((void)Device::upload(exec, bad), std::logic_error);
  }
}

// ---- strategies on one GPU ---------------------------------------------------------------------------

// The shared distributed check (tests/support/distributed_check.hpp) with shards in device memory; each
// rank makes its own CudaFlash (its own streams) on device 0.
template <class S, class T>
test::Errors check_strategy_on_gpu(const test::MaskedBatch& batch, const AttentionShape& shape, int world,
                                   typename S::Arguments args, std::uint32_t seed = 7,
                                   const std::vector<double>& sinks = {}) {
  using Kernel = attention::CudaFlash<T>;
  return test::distributed_check<Kernel, test::DeviceStorage>(
      batch, shape, world,
      [&](backend::inproc::Transport& t) -> std::unique_ptr<runtime::AttentionEngine<Kernel>> {
        return std::make_unique<DistributedAttention<S, Kernel>>(t, shape, args, Kernel{});
      },
      seed, sinks);
}

enum class Mix { kLognormal, kLongTail };

// B sequences of unequal lengths (70 to 150 tokens): lognormal documents (median 12), or one long
// document and short ones (documents of length 1 included).
DocumentBatch make_batch(int sequences, Mix mix, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<std::vector<std::int64_t>> seqs;
  for (int b = 0; b < sequences; ++b) {
    const std::int64_t tokens = 70 + 23 * b + static_cast<std::int64_t>(rng() % 31);
    if (mix == Mix::kLognormal) {
      seqs.push_back(test::lognormal_docs(tokens, 12.0, 1.0, rng));
    } else {
      const std::int64_t big = tokens - static_cast<std::int64_t>(rng() % 8);
      std::vector<std::int64_t> docs{big};
      for (std::int64_t left = tokens - big; left > 0;) {
        const std::int64_t len = std::min<std::int64_t>(left, 1 + static_cast<std::int64_t>(rng() % 3));
        docs.push_back(len);
        left -= len;
      }
      std::shuffle(docs.begin(), docs.end(), rng);
      seqs.push_back(docs);
    }
  }
  return DocumentBatch(seqs);
}

constexpr std::array kWorlds{1, 2, 3, 4, 8};
constexpr double kFp32Tolerance = 1e-4;
constexpr double kBf16Tolerance = 2.5e-2;

// Heads divisible by every group size a world can make (Ulysses splits heads over the ranks).
AttentionShape shape_for(int world) {
  return world == 3 ? AttentionShape{6, 3, 64} : AttentionShape{8, 2, 64};
}

template <class Combination>
void check_combination_on_gpu(Combination) {
  using S = typename Combination::strategy;
  const std::string name = Combination::name();
  typename S::Arguments args = Combination::arguments();
  int accepted = 0, refused = 0;
  for (int world : kWorlds) {
    const int sequences = 1 + (world + static_cast<int>(name.size())) % 4;
    const Mix mix = world % 2 == 0 ? Mix::kLognormal : Mix::kLongTail;
    const AttentionShape shape = shape_for(world);
    const DocumentBatch batch = make_batch(sequences, mix, 1000u * static_cast<unsigned>(world) + 29u);
    args.ranks_per_node = world >= 4 ? world / 2 : world;  // two "nodes" from 4 ranks up
    INFO(name << ": world " << world << ", " << sequences << " sequences, " << batch.documents().size()
              << " documents, heads " << shape.heads_q << ":" << shape.heads_kv << ", fp32");
    if (!S::can_implement(args, batch, shape, Topology{world, args.ranks_per_node})) {
      ++refused;  // the CPU tests check that refusals say why and throw before communicating
      continue;
    }
    ++accepted;
    const auto err = check_strategy_on_gpu<S, float>(batch, shape, world, args);
    CHECK(err.o < kFp32Tolerance);
    CHECK(err.lse < kFp32Tolerance);
    CHECK(err.dq < kFp32Tolerance);
    CHECK(err.dk < kFp32Tolerance);
    CHECK(err.dv < kFp32Tolerance);
    CHECK(err.bytes_match);
  }
  MESSAGE(name << ": " << accepted << " world sizes run on the GPU, " << refused << " refused");
  CHECK(accepted >= 3);  // a combination that refuses most worlds is not being tested
}

void device_world_transport_cases() {
  for (int n : {2, 4}) {
    INFO("world size " << n);
    test::Failures failures;
    gpu::device_world(n).run([&](backend::inproc::Transport& t) {
      SEQPAR_CUDA_CHECK(cudaSetDevice(0), "rank");
      test::all_transport_cases(t, failures);
    });
    for (const auto& m : failures.messages()) FAIL_CHECK(m);
  }
}

void device_world_device_buffers() {
  constexpr int kRanks = 4;
  constexpr std::size_t kBytes = 1 << 20;
  test::Failures failures;
  gpu::device_world(kRanks).run([&](backend::inproc::Transport& t) {
    SEQPAR_CUDA_CHECK(cudaSetDevice(0), "rank");
    const int me = t.rank(), next = (me + 1) % kRanks, prev = (me + kRanks - 1) % kRanks;
    const auto mine = test::cases::payload(me, next, kBytes);
    gpu::DeviceArray<std::byte> send(mine), recv(kBytes);
    SEQPAR_CUDA_CHECK(cudaDeviceSynchronize(), "rank");  // pageable uploads may land after cudaMemcpy returns
    auto r = t.irecv(recv.span(), prev, 3);
    auto s = t.isend(std::span<const std::byte>(send.data(), kBytes), next, 3);
    t.wait(s);
    t.wait(r);
    const auto got = recv.to_host();
    failures.expect(test::cases::holds(got, prev, me), test::cases::at(me, "ring payload"));
    // all_to_all_v: rank i sends (i + j + 1) * 1000 bytes to rank j.
    std::vector<std::size_t> sc(kRanks), rc(kRanks);
    std::vector<std::byte> out;
    for (int j = 0; j < kRanks; ++j) {
      sc[static_cast<std::size_t>(j)] = static_cast<std::size_t>((me + j + 1) * 1000);
      rc[static_cast<std::size_t>(j)] = static_cast<std::size_t>((j + me + 1) * 1000);
      const auto p = test::cases::payload(me, j, sc[static_cast<std::size_t>(j)], 9);
      out.insert(out.end(), p.begin(), p.end());
    }
    std::size_t in_bytes = 0;
    for (std::size_t x : rc) in_bytes += x;
    gpu::DeviceArray<std::byte> dsend(out), drecv(in_bytes);
    SEQPAR_CUDA_CHECK(cudaDeviceSynchronize(), "rank");
    t.all_to_all_v(std::span<const std::byte>(dsend.data(), out.size()), sc, drecv.span(), rc);
    const auto in = drecv.to_host();
    std::size_t at = 0;
    for (int j = 0; j < kRanks; ++j) {
      const std::size_t len = rc[static_cast<std::size_t>(j)];
      failures.expect(test::cases::holds(std::span<const std::byte>(in.data() + at, len), j, me, 9),
                      test::cases::at(me, "all_to_all_v block from rank " + std::to_string(j)));
      at += len;
    }
  });
  for (const auto& m : failures.messages()) FAIL_CHECK(m);
}

void bf16_subset() {
  using ZigzagRing = Strategy<partition::Zigzag, comm::Ring>;
  using Ulysses = Strategy<partition::Uniform, comm::AllToAll>;
  using HybridGather = Strategy<partition::Hybrid, comm::AllGather>;
  using Usp = Strategy<partition::BatchAware<partition::PerDoc>, test::communicators::HierarchicalA2aRing>;
  const AttentionShape shape{8, 2, 128};
  for (int world : {4, 8}) {
    const DocumentBatch batch = make_batch(2, Mix::kLognormal, 77u + static_cast<unsigned>(world));
    int run = 0;
    const auto check = [&]<class S>(const char* name, typename S::Arguments args) {
      INFO(name << ", world " << world << ", bf16");
      if (!S::can_implement(args, batch, shape,
                            Topology{world, args.ranks_per_node == 0 ? world : args.ranks_per_node}))
        return;
      ++run;
      const auto err = check_strategy_on_gpu<S, __nv_bfloat16>(batch, shape, world, args);
      CHECK(err.o < kBf16Tolerance);
      CHECK(err.lse < kBf16Tolerance);
      CHECK(err.dq < kBf16Tolerance);
      CHECK(err.dk < kBf16Tolerance);
      CHECK(err.dv < kBf16Tolerance);
      CHECK(err.bytes_match);
    };
    typename ZigzagRing::Arguments ring;
    ring.comm.sharding_aware = true;
    check.template operator()<ZigzagRing>("Zigzag x Ring(sharding-aware)", ring);
    check.template operator()<Ulysses>("Uniform x AllToAll", {});
    typename HybridGather::Arguments gather;
    gather.comm.sharding_aware = true;
    check.template operator()<HybridGather>("Hybrid x AllGather(sharding-aware)", gather);
    typename Usp::Arguments usp;
    usp.ranks_per_node = world / 2;
    check.template operator()<Usp>("BatchAware<PerDoc> x Hierarchical", usp);
    CHECK(run >= 3);
  }
}

// MLA's head sizes (q/k 192, v 128) through the executor: CudaFlash with prepared Params at 192/128, and
// DataOps<CudaExec> moving K-side and V-side pieces of unequal widths. Compiled, never run on a GPU yet.
template <class T>
void mla_subset(double tolerance) {
  using ZigzagRing = Strategy<partition::Zigzag, comm::Ring>;
  using Ulysses = Strategy<partition::Uniform, comm::AllToAll>;
  using HybridGather = Strategy<partition::Hybrid, comm::AllGather>;
  AttentionShape shape{8, 2, 192};
  shape.head_dim_v = 128;
  for (int world : {2, 4}) {
    const DocumentBatch batch = make_batch(2, Mix::kLognormal, 91u + static_cast<unsigned>(world));
    int run = 0;
    const auto check = [&]<class S>(const char* name, typename S::Arguments args) {
      INFO(name << ", world " << world << ", 192/128, " << (std::is_same_v<T, float> ? "fp32" : "bf16"));
      if (!S::can_implement(args, batch, shape,
                            Topology{world, args.ranks_per_node == 0 ? world : args.ranks_per_node}))
        return;
      ++run;
      const auto err = check_strategy_on_gpu<S, T>(batch, shape, world, args);
      CHECK(err.o < tolerance);
      CHECK(err.lse < tolerance);
      CHECK(err.dq < tolerance);
      CHECK(err.dk < tolerance);
      CHECK(err.dv < tolerance);
      CHECK(err.bytes_match);
    };
    typename ZigzagRing::Arguments ring;
    ring.comm.sharding_aware = true;
    check.template operator()<ZigzagRing>("Zigzag x Ring(sharding-aware)", ring);
    check.template operator()<Ulysses>("Uniform x AllToAll", {});
    check.template operator()<HybridGather>("Hybrid x AllGather", {});
    CHECK(run >= 2);
  }
}

}  // namespace
}  // namespace seqpar

TEST_SUITE("cuda") {
  TEST_CASE("DataOps<CudaExec> matches DataOps<HostExec>: pack, unpack, zero, fill_empty, merge") {
    for (std::uint32_t seed : {1u, 2u, 3u}) {
      seqpar::check_data_ops<float>(64, seed);
      seqpar::check_data_ops<float>(12, seed);  // rows of 48 bytes: vector windows straddle rows
      seqpar::check_data_ops<__nv_bfloat16>(64, seed);
      seqpar::check_data_ops<__nv_bfloat16>(12, seed);  // rows of 24 bytes: element by element
      seqpar::check_data_ops<__half>(128, seed);
    }
  }

  TEST_CASE("device world: the transport cases on host buffers, through device mailboxes") {
    seqpar::device_world_transport_cases();
  }

  TEST_CASE("device world: device buffers through a ring of isend/irecv and an all_to_all_v") {
    seqpar::device_world_device_buffers();
  }

  // One test case per partitioner, each running every communicator configuration on 1, 2, 3, 4 and 8
  // ranks sharing the GPU.
  TEST_CASE_TEMPLATE_DEFINE("every strategy on one GPU (fp32): partitioner x every communicator", P, every_strategy) {
    seqpar::test::for_each_communicator<P>([](auto combination) { seqpar::check_combination_on_gpu(combination); });
  }
  TEST_CASE_TEMPLATE_APPLY(every_strategy, seqpar::test::Partitioners);

  TEST_CASE("a bf16 subset on one GPU, head_dim 128") {
    seqpar::bf16_subset();
  }

  TEST_CASE("MLA's 192/128 on one GPU: ring, all-to-all and all-gather strategies, fp32 and bf16") {
    seqpar::mla_subset<float>(seqpar::kFp32Tolerance);
    seqpar::mla_subset<__nv_bfloat16>(seqpar::kBf16Tolerance);
  }

  TEST_CASE("attention sinks on one GPU: DataOps<CudaExec>'s epilogue and the gradient's gather (fp32)") {
    using namespace seqpar;
    std::mt19937 rng(4);
    const DocumentBatch batch({test::lognormal_docs(120, 12.0, 1.0, rng), test::lognormal_docs(80, 6.0, 1.0, rng)});
    const AttentionShape shape{4, 2, 64};
    const std::vector<double> sinks{4.0, -0.5, 1.25, -std::numeric_limits<double>::infinity()};
    using Ring = Strategy<partition::Zigzag, comm::Ring>;
    using Hier = Strategy<partition::Hybrid, comm::Hierarchical<comm::AllToAll, comm::Ring>>;
    Hier::Arguments hier;
    hier.ranks_per_node = 2;
    for (const test::Errors& e :
         {check_strategy_on_gpu<Ring, float>(batch, shape, 3, {}, 5, sinks),
          check_strategy_on_gpu<Hier, float>(test::windowed(batch, 24), shape, 4, hier, 5, sinks)}) {
      CHECK(e.o < 1e-4);
      CHECK(e.lse < 1e-4);
      CHECK(e.dq < 1e-4);
      CHECK(e.dk < 1e-4);
      CHECK(e.dv < 1e-4);
      CHECK(e.dsinks < 1e-4);
      CHECK(e.bytes_match);
    }
  }
}
