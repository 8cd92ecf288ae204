// SPDX-License-Identifier: Apache-2.0
// The scaffolding every example shares, so that each example file shows only its strategy: the
// whole-batch tensors, argument parsing, packed-batch generation, running a strategy on in-process
// ranks (gathering each rank's shard and scattering its outputs back), and the check against the fp64
// reference. Not part of the library.
#pragma once

#include <seqpar/seqpar.hpp>
#include <seqpar/train/shard.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

namespace seqpar::examples {

template <class T>
struct Tensors : AttentionTensors<T> {  // the whole batch (or a rank's rows), with the examples' input fills
  using AttentionTensors<T>::AttentionTensors;
  // Inputs Q, K, V, dO drawn from N(0, 1), in that order.
  void randomize_inputs(std::mt19937& rng) {
    std::normal_distribution<float> normal(0.f, 1.f);
    for (auto* t : {&this->q, &this->k, &this->v, &this->dout})
      for (auto& x : t->storage) x = normal(rng);
  }
  void copy_inputs(const Tensors& from) {
    this->q = from.q, this->k = from.k, this->v = from.v, this->dout = from.dout;
  }
};

// Per rank: tokens owned, bytes sent by forward and by backward, and bytes its compiled forward and
// backward programs send to ranks on other nodes.
struct RankStats {
  std::int64_t tokens = 0;
  std::uint64_t forward_bytes = 0, backward_bytes = 0;
  std::uint64_t inter_node_bytes = 0;
};

inline double mib(std::uint64_t bytes) {
  return double(bytes) / (1 << 20);
}
inline double ms_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

struct Options {
  bool smoke = false;
  int threads = 1;
  std::int64_t tokens = 0;
};
// [--smoke] [--tokens T] [--threads K]; --smoke sets `smoke_tokens`. False (after a message) on an
// unknown argument.
inline bool parse_options(int argc, char** argv, Options& options, std::int64_t smoke_tokens) {
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--smoke") {
      options.smoke = true, options.tokens = smoke_tokens;
    } else if (a == "--tokens" && i + 1 < argc) {
      options.tokens = std::stoll(argv[++i]);
    } else if (a == "--threads" && i + 1 < argc) {
      options.threads = std::stoi(argv[++i]);
    } else {
      std::fprintf(stderr, "unknown argument %s\n", a.c_str());
      return false;
    }
  }
  return true;
}

// `count` sequences of `tokens` tokens each, packed with documents of lognormal length (median
// `median`, sigma 1, each at most `longest`), drawn from `rng`.
inline std::vector<std::vector<std::int64_t>> lognormal_sequences(
    std::mt19937& rng, int count, std::int64_t tokens, double median,
    std::int64_t longest = std::numeric_limits<std::int64_t>::max()) {
  std::lognormal_distribution<double> doc_len(std::log(median), 1.0);
  std::vector<std::vector<std::int64_t>> sequences(static_cast<std::size_t>(count));
  for (auto& docs : sequences)
    for (std::int64_t left = tokens; left > 0; left -= docs.back())
      docs.push_back(std::clamp<std::int64_t>(std::llround(doc_len(rng)), 1, std::min(left, longest)));
  return sequences;
}

// A long-tail sequence of `tokens` tokens: the documents `longs`, then lognormal short ones (median
// `median`, at most `longest`) filling the rest, shuffled; all drawn from `rng`.
inline std::vector<std::int64_t> long_tail_sequence(std::mt19937& rng, std::int64_t tokens,
                                                    const std::vector<std::int64_t>& longs, double median,
                                                    std::int64_t longest) {
  std::int64_t used = 0;
  for (std::int64_t l : longs) used += l;
  std::vector<std::int64_t> docs = longs;
  const auto shorts = lognormal_sequences(rng, 1, tokens - used, median, longest).front();
  docs.insert(docs.end(), shorts.begin(), shorts.end());
  std::shuffle(docs.begin(), docs.end(), rng);
  return docs;
}

// Bytes `program` of world rank `rank` sends to ranks on other nodes (`ranks_per_node` 0: one node).
inline std::uint64_t inter_node_bytes(const comm::Program& program, int rank, int ranks, int ranks_per_node) {
  if (ranks_per_node <= 0) return 0;
  const std::vector<std::uint64_t> to = program.bytes_to(ranks, sizeof(float), sizeof(float));
  std::uint64_t sum = 0;
  for (int peer = 0; peer < ranks; ++peer)
    if (peer / ranks_per_node != rank / ranks_per_node) sum += to[std::size_t(peer)];
  return sum;
}

// Runs the engine `make(transport)` builds (a std::unique_ptr to a runtime::AttentionEngine over
// CpuFlash<float>: DistributedAttention, plan::SelectedAttention) on `ranks` in-process ranks
// (`ranks_per_node` of them per node; 0: one node). Every rank takes its shard of `io`'s inputs
// (train::shard: its owned ranges, in plan order; under zigzag or hybrid sharding several chunks, not one
// contiguous range), runs forward and backward, and writes its outputs back into `io`
// (train::unshard_local: ranks own disjoint tokens, so they write disjoint rows). `after(attn, rank)`, if
// given, runs on every rank once its outputs are back (reports that need the engine, e.g. its choice).
struct NothingAfter {
  template <class Attn>
  void operator()(Attn&, int) const {}
};
template <class Make, class After = NothingAfter>
std::vector<RankStats> run_engine(const DocumentBatch& batch, const AttentionShape& shape, Tensors<float>& io,
                                  int ranks, int ranks_per_node, Make make, After after = {}) {
  std::vector<RankStats> stats(static_cast<std::size_t>(ranks));
  backend::inproc::World(ranks).run([&](auto& transport) {
    const auto engine = make(transport);
    auto& attn = *engine;
    const ShardPlan& plan = attn.plan(batch);
    const int rank = transport.rank();
    Tensors<float> l(attn.local_tokens(batch), shape);  // (local tokens, heads, d); LSE (Hq, local tokens)
    for (auto [g, t] : {std::pair{&io.q, &l.q}, {&io.k, &l.k}, {&io.v, &l.v}, {&io.dout, &l.dout}})
      train::shard(plan, rank, g->view(), t->view());
    RankStats& s = stats[static_cast<std::size_t>(rank)];
    s.tokens = l.q.tokens;
    attn.forward(batch, l.q.view(), l.k.view(), l.v.view(), l.o.view(), l.lse.view());
    s.forward_bytes = attn.last_bytes_sent();
    attn.backward(batch, l.q.view(), l.k.view(), l.v.view(), l.o.view(), l.lse.view(), l.dout.view(), l.dq.view(),
                  l.dk.view(), l.dv.view());
    s.backward_bytes = attn.last_bytes_sent();
    s.inter_node_bytes = inter_node_bytes(attn.program(batch).forward, rank, ranks, ranks_per_node) +
                         inter_node_bytes(attn.program(batch).backward, rank, ranks, ranks_per_node);
    for (auto [t, g] : {std::pair{&l.o, &io.o}, {&l.dq, &io.dq}, {&l.dk, &io.dk}, {&l.dv, &io.dv}})
      train::unshard_local(plan, rank, t->view(), g->view());
    train::unshard_local(plan, rank, l.lse.view(), io.lse.view());
    after(attn, rank);
  });
  return stats;
}

// The query rows to check: every row under --smoke, else 256 sampled ones (drawn from `rng`).
inline std::vector<bool> checked_rows(std::int64_t n, bool smoke, std::mt19937& rng) {
  std::vector<bool> checked(static_cast<std::size_t>(n), smoke);
  std::uniform_int_distribution<std::int64_t> pick(0, n - 1);
  for (int i = 0; i < (smoke ? 0 : 256); ++i) checked[static_cast<std::size_t>(pick(rng))] = true;
  return checked;
}

// fp64 reference from the inputs of `in`: the whole batch (`checked` all true), or only query rows
// marked in `checked`, each a slice over its document's prefix (then O, LSE and dQ of those rows are
// exact; dK and dV would need every query and are not meaningful).
inline Tensors<double> reference(const DocumentBatch& batch, const AttentionShape& shape, const Tensors<float>& in,
                                 const std::vector<bool>& checked) {
  Tensors<double> r(batch.total_tokens(), shape);
  for (auto [from, to] : {std::pair{&in.q, &r.q}, {&in.k, &r.k}, {&in.v, &r.v}, {&in.dout, &r.dout}})
    std::copy(from->storage.begin(), from->storage.end(), to->storage.begin());
  std::vector<AttnSlice> slices;
  for (const Document& doc : batch.documents())
    for (std::int64_t t = doc.tokens.begin; t < doc.tokens.end; ++t)
      if (checked[static_cast<std::size_t>(t)])
        slices.push_back({{t, t + 1}, {doc.tokens.begin, t + 1}, Mask::causal(t - doc.tokens.begin)});
  const attention::Reference<double> ref;
  ref.forward(shape, r.q.view(), r.k.view(), r.v.view(), slices, r.o.view(), r.lse.view());
  ref.backward(shape, r.q.view(), r.k.view(), r.v.view(), r.o.view(), r.lse.view(), r.dout.view(), slices, r.dq.view(),
               r.dk.view(), r.dv.view());
  return r;
}

// max |got - want| / max |want| over the checked tokens; `lse`: (heads, tokens) layout.
template <class W, class G>
double rel_error(const W& want, const G& got, const std::vector<bool>& checked, bool lse = false) {
  double err = 0, scale = 0;
  const std::size_t n = checked.size(), per_token = want.storage.size() / n;
  for (std::size_t i = 0; i < want.storage.size(); ++i)
    if (checked[lse ? i % n : i / per_token]) {
      scale = std::max(scale, std::abs(double(want.storage[i])));
      err = std::max(err, std::abs(double(want.storage[i]) - double(got.storage[i])));
    }
  return err / scale;
}

// Relative errors of one run against the fp64 reference (dK, dV: 0 unless the whole batch is checked).
struct Errors {
  double o = 0, lse = 0, dq = 0, dk = 0, dv = 0;
  // fp32 storage and accumulation: 1e-5 for O and LSE; dK and dV sum fp32 products over every query of a
  // document, so gradient error grows with document length: 1e-4 (measured ~1e-6 at 2K tokens).
  [[nodiscard]] bool ok() const { return std::max(o, lse) < 1e-5 && std::max({dq, dk, dv}) < 1e-4; }
};

// Compares `got` with `ref` on the checked rows and prints "error vs fp64 reference on ...: O ..., ..."
// (a caller may print a label first).
inline Errors check(const Tensors<double>& ref, const Tensors<float>& got, const std::vector<bool>& checked,
                    bool smoke) {
  const Errors e{rel_error(ref.o, got.o, checked), rel_error(ref.lse, got.lse, checked, true),
                 rel_error(ref.dq, got.dq, checked), smoke ? rel_error(ref.dk, got.dk, checked) : 0,
                 smoke ? rel_error(ref.dv, got.dv, checked) : 0};
  std::printf("error vs fp64 reference on %s, max |err| / max |ref|: O %.2e, LSE %.2e, dQ %.2e",
              smoke ? "the whole batch" : "256 sampled rows", e.o, e.lse, e.dq);
  if (smoke)
    std::printf(", dK %.2e, dV %.2e\n", e.dk, e.dv);
  else
    std::printf(" (dK, dV: --smoke)\n");
  return e;
}

}  // namespace seqpar::examples
