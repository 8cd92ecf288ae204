// SPDX-License-Identifier: Apache-2.0
// One IR, one lowering: what the replay prices is what the executor runs. For every partitioner x
// communicator combination on 1..8 in-process ranks, plain and chunked (DPP: a long document split
// across chunks, the prefix carry moving), each rank's bytes sent (as its transport counted them),
// kernel calls, slices, (query, key) pairs and merges (as an instrumented kernel and execution
// context counted them) equal, rank by rank, what replay::Replay reports for the same programs.
#include <doctest/doctest.h>

#include <seqpar/replay/hardware.hpp>
#include <seqpar/replay/simulator.hpp>
#include <seqpar/schedule/dynamic_chunk.hpp>
#include <seqpar/seqpar.hpp>

#include <cstdint>
#include <mutex>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "support/strategy_list.hpp"

namespace seqpar {
namespace {

// What one rank did, counted where it happens.
struct Counts {
  std::int64_t kernel_calls = 0, slices = 0, head_pairs = 0, merges = 0;
  std::uint64_t bytes = 0;
  Counts& operator+=(const Counts& o) {
    kernel_calls += o.kernel_calls, slices += o.slices, head_pairs += o.head_pairs, merges += o.merges;
    bytes += o.bytes;
    return *this;
  }
};
thread_local Counts t_counts;  // each in-process rank is a thread

// The host context under another type, so that the executor's data ops on it can be counted.
struct CountingExec : HostExec {
  CountingExec() : HostExec(1) {}
};

// The reference kernel, counting its calls.
struct CountingKernel {
  using kernel_category = attention::kernel_tag;
  using value_type = double;
  using accum_type = double;
  using exec_type = CountingExec;
  attention::Reference<double> inner;

  [[nodiscard]] CountingExec exec() const { return {}; }
  [[nodiscard]] static Status can_implement(const AttentionShape&) { return Status::success(); }
  [[nodiscard]] std::size_t workspace_bytes(const AttentionShape& s, std::int64_t q, std::int64_t k) const {
    return inner.workspace_bytes(s, q, k);
  }
  static void count(const AttentionShape& shape, std::span<const AttnSlice> slices) {
    t_counts.kernel_calls += 1;
    t_counts.slices += static_cast<std::int64_t>(slices.size());
    t_counts.head_pairs += total_area(slices) * shape.heads_q;
  }
  template <class... Args>
  void forward(const CountingExec& e, const AttentionShape& shape, ThdView<const double> q, ThdView<const double> k,
               ThdView<const double> v, std::span<const AttnSlice> slices, Args&&... rest) const {
    count(shape, slices);
    inner.forward(e, shape, q, k, v, slices, std::forward<Args>(rest)...);
  }
  template <class... Args>
  void backward(const CountingExec& e, const AttentionShape& shape, ThdView<const double> q, ThdView<const double> k,
                ThdView<const double> v, ThdView<const double> o, LseView<const double> lse, ThdView<const double> dout,
                std::span<const AttnSlice> slices, Args&&... rest) const {
    count(shape, slices);
    inner.backward(e, shape, q, k, v, o, lse, dout, slices, std::forward<Args>(rest)...);
  }
};
static_assert(attention::AttentionKernel<CountingKernel>);

}  // namespace

// The executor's data ops on CountingExec: the host's, merges counted.
template <>
struct runtime::DataOps<CountingExec> : runtime::DataOps<HostExec> {
  template <class T, class A>
  static void merge(const CountingExec& e, ThdView<T> o, LseView<A> lse, ThdView<T> o_part, LseView<A> lse_part,
                    TableSlice<AttnSlice> slices) {
    t_counts.merges += 1;
    DataOps<HostExec>::merge(e, o, lse, o_part, lse_part, slices);
  }
};

namespace {

// What the replay says each rank of `programs` (one per world rank) does.
std::vector<Counts> replayed(const std::vector<comm::Program>& programs, const Topology& topo,
                             const AttentionShape& shape) {
  replay::SimulationOptions opt;
  opt.hardware = replay::profiles::h100_sxm();
  opt.value_bytes = sizeof(double);
  opt.lse_bytes = sizeof(double);
  const replay::SimulationReport rep = replay::Replay(programs, topo, shape, opt).run();
  std::vector<Counts> out;
  for (const replay::RankTiming& r : rep.ranks)
    out.push_back({r.kernel_calls, r.slices, r.head_pairs, r.merges, r.bytes_intra + r.bytes_inter});
  return out;
}

DocumentBatch long_tail(std::mt19937& rng, int sequences) {
  std::vector<std::vector<std::int64_t>> seqs;
  for (int b = 0; b < sequences; ++b) {
    std::vector<std::int64_t> docs{std::uniform_int_distribution<std::int64_t>(40, 90)(rng)};
    const int n = std::uniform_int_distribution<int>(1, 5)(rng);
    for (int i = 0; i < n; ++i) docs.push_back(std::uniform_int_distribution<std::int64_t>(1, 20)(rng));
    std::shuffle(docs.begin(), docs.end(), rng);
    seqs.push_back(docs);
  }
  return DocumentBatch(seqs);
}

// Runs forward + backward of `batch` (plain) or of its chunks (chunked) and compares, per rank, the
// counts with the replay of the same programs. Returns the number of compared (rank, quantity) pairs
// that differ; `moved` gets the bytes the run sent.
template <class S>
int compare(const DocumentBatch& batch, AttentionMask mask, int world, typename S::Arguments args, bool chunked,
            std::uint64_t& moved, std::string& first_difference) {
  const AttentionShape shape{4, 2, 8};
  const Topology topo{world, args.ranks_per_node == 0 ? world : args.ranks_per_node};
  const std::vector<Chunk> chunks =
      chunked ? schedule::DynamicChunk{{.token_capacity = 48, .time_target = 0, .slices = 0, .cost = {}}}.chunks(batch)
              : std::vector<Chunk>{};
  std::vector<Counts> counted(static_cast<std::size_t>(world));
  // Programs by (call, rank): the strategy's (forward, backward) of each batch run, then, chunked, the
  // carry's prefix programs of each chunk.
  std::vector<std::vector<comm::Program>> programs;
  const std::size_t calls = chunked ? 4 * chunks.size() : 2;
  programs.assign(calls, std::vector<comm::Program>(static_cast<std::size_t>(world)));
  std::mutex mu;
  backend::inproc::World(world).run([&](backend::inproc::Transport& t) {
    const auto r = static_cast<std::size_t>(t.rank());
    DistributedAttention<S, CountingKernel> attn(t, shape, args);
    t_counts = {};
    std::uint64_t bytes = 0;
    const auto run = [&](const DocumentBatch& b, std::size_t call, auto&& body) {
      const std::int64_t n = attn.local_tokens(b);
      ThdTensor<double> q(n, 4, 8), k(n, 2, 8), v(n, 2, 8), o(n, 4, 8), dout(n, 4, 8), dq(n, 4, 8), dk(n, 2, 8),
          dv(n, 2, 8);
      LseTensor<double> lse(4, n);
      body(q, k, v, o, lse, dout, dq, dk, dv);
      programs[call][r] = attn.program(b, mask).forward;
      programs[call + 1][r] = attn.program(b, mask).backward;
    };
    if (!chunked) {
      run(batch, 0, [&](auto& q, auto& k, auto& v, auto& o, auto& lse, auto& dout, auto& dq, auto& dk, auto& dv) {
        attn.forward(batch, mask, q.view(), k.view(), v.view(), o.view(), lse.view());
        bytes += attn.last_bytes_sent();
        attn.backward(batch, mask, q.view(), k.view(), v.view(), o.view(), lse.view(), dout.view(), dq.view(),
                      dk.view(), dv.view());
        bytes += attn.last_bytes_sent();
      });
    } else {
      runtime::ChunkedAttention<CountingKernel> ca(attn);
      ca.begin(chunks, mask);
      const int nc = ca.num_chunks();
      struct Local {
        ThdTensor<double> q, k, v, o, dout, dq, dk, dv;
        LseTensor<double> lse;
      };
      std::vector<Local> loc;
      for (int c = 0; c < nc; ++c) {
        const std::int64_t n = ca.local_tokens(c);
        loc.push_back({ThdTensor<double>(n, 4, 8), ThdTensor<double>(n, 2, 8), ThdTensor<double>(n, 2, 8),
                       ThdTensor<double>(n, 4, 8), ThdTensor<double>(n, 4, 8), ThdTensor<double>(n, 4, 8),
                       ThdTensor<double>(n, 2, 8), ThdTensor<double>(n, 2, 8), LseTensor<double>(4, n)});
      }
      for (int c = 0; c < nc; ++c) {
        Local& l = loc[static_cast<std::size_t>(c)];
        ca.forward(c, l.q.view(), l.k.view(), l.v.view(), l.o.view(), l.lse.view());
        bytes += ca.last_bytes_sent();  // the prefix program; the strategy's below
        bytes += attn.last_bytes_sent();
      }
      for (int c = nc - 1; c >= 0; --c) {
        Local& l = loc[static_cast<std::size_t>(c)];
        ca.backward(c, l.q.view(), l.k.view(), l.v.view(), l.o.view(), l.lse.view(), l.dout.view(), l.dq.view(),
                    l.dk.view(), l.dv.view());
        bytes += ca.last_bytes_sent();
        bytes += attn.last_bytes_sent();
      }
      for (int c = 0; c < nc; ++c) {
        const auto at = 4 * static_cast<std::size_t>(c);
        programs[at][r] = attn.program(ca.chunk(c).batch, mask).forward;
        programs[at + 1][r] = attn.program(ca.chunk(c).batch, mask).backward;
        programs[at + 2][r] = ca.program(c, 0);
        programs[at + 3][r] = ca.program(c, 2);
      }
    }
    Counts mine = t_counts;
    mine.bytes = bytes;
    std::lock_guard lock(mu);
    counted[r] = mine;
  });
  std::vector<Counts> priced(static_cast<std::size_t>(world));
  for (const auto& call : programs) {
    const auto rep = replayed(call, topo, shape);
    for (std::size_t r = 0; r < priced.size(); ++r) priced[r] += rep[r];
  }
  int differ = 0;
  moved = 0;
  for (std::size_t r = 0; r < priced.size(); ++r) {
    const Counts &a = counted[r], &b = priced[r];
    moved += a.bytes;
    const auto check = [&](const char* what, std::int64_t x, std::int64_t y) {
      if (x == y) return;
      if (differ++ == 0)
        first_difference = "rank " + std::to_string(r) + " " + what + ": executor " + std::to_string(x) + ", replay " +
                           std::to_string(y);
    };
    check("kernel calls", a.kernel_calls, b.kernel_calls);
    check("slices", a.slices, b.slices);
    check("head pairs", a.head_pairs, b.head_pairs);
    check("merges", a.merges, b.merges);
    check("bytes sent", static_cast<std::int64_t>(a.bytes), static_cast<std::int64_t>(b.bytes));
  }
  return differ;
}

}  // namespace
}  // namespace seqpar

TEST_SUITE("replay") {
  TEST_CASE("replay = executor: bytes, kernel calls, slices, pairs and merges per rank, every combination") {
    using namespace seqpar;
    int runs = 0;
    std::uint64_t plain_bytes = 0, chunked_bytes = 0, windowed_bytes = 0;
    test::for_each_combination([&]<class C>(C) {
      using S = typename C::strategy;
      for (int world : {1, 2, 3, 4, 6, 8}) {
        typename S::Arguments args = C::arguments();
        args.ranks_per_node = world >= 4 ? world / 2 : world;
        std::mt19937 rng(static_cast<std::uint32_t>(world * 31 + static_cast<int>(C::name().size())));
        const DocumentBatch batch = long_tail(rng, 1 + world % 3);
        const AttentionShape shape{4, 2, 8};
        if (!S::can_implement(args, batch, shape, Topology{world, args.ranks_per_node}).ok) continue;
        // Plain, chunked, and chunked under a sliding window (windowed prefix slices, cut carry).
        for (int mode : {0, 1, 2}) {
          const bool chunked = mode > 0;
          const DocumentBatch& b = batch;
          const AttentionMask mask{mode == 2 ? 7 : 0};
          if (chunked) {
            bool ok = true;
            for (const Chunk& ch :
                 schedule::DynamicChunk{{.token_capacity = 48, .time_target = 0, .slices = 0, .cost = {}}}.chunks(b))
              ok = ok && S::can_implement(args, ch.batch, shape, Topology{world, args.ranks_per_node}).ok;
            if (!ok) continue;
          }
          INFO(C::name() << ", world " << world << (chunked ? ", chunked" : "") << (mode == 2 ? ", window 7" : ""));
          std::uint64_t moved = 0;
          std::string difference;
          CHECK_MESSAGE(compare<S>(b, mask, world, args, chunked, moved, difference) == 0, difference);
          (mode == 0 ? plain_bytes : mode == 1 ? chunked_bytes : windowed_bytes) += moved;
          ++runs;
        }
      }
    });
    CHECK(runs > 200);
    CHECK(plain_bytes > 0);  // the comparison saw traffic, not only local work
    CHECK(chunked_bytes > 0);
    CHECK(windowed_bytes > 0);
    CHECK(windowed_bytes < chunked_bytes);  // the window cuts the carry's traffic too
  }
}
