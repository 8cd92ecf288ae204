// SPDX-License-Identifier: Apache-2.0
// 09: a tiny decoder trained end to end, its attention distributed by seqpar, on 4 in-process ranks.
//
// testing::TinyTransformer<float> (2 layers: embedding, RMSNorm, RoPE, GQA attention, SwiGLU MLP, tied
// output, cross-entropy; hand-written backward) trained with AdamW for 50 steps on a synthetic packed
// corpus: each step a fresh batch of 2 sequences packed with documents of a long-tail length mix (many
// short ones, a few long ones), whose tokens follow one of four hidden rules per document, so that
// the model must attend within the document to predict the next token. Three runs from the same
// initialization see the same batches:
//  - 1 rank (the single-device reference);
//  - 4 ranks, Hybrid (FlashCP: short documents whole, long ones cut) x sharding-aware Ring;
//  - 4 ranks, BASP with 2 groups (one sequence each) x sharding-aware Ring inside each group.
// Each rank of a run holds only its rows: train::shard gives it its token ids, train::token_meta the
// RoPE position of each row within its document, train::labels the next token (fetched from the rank
// that holds it when a document is cut there), train::combine the loss totals of the whole world (the
// gradient scale is 1 / label tokens of the batch), and train::all_reduce_sum the parameter
// gradients. The example checks that every step's loss of the 4-rank runs equals the 1-rank loss
// within 1e-5 relative and that the final parameters match (5e-5 of the largest), prints tokens/s, writes the loss
// curve as CSV and SVG (09_train_tiny_loss.csv / .svg in --out, default the working directory).
//   usage: 09_train_tiny [--smoke] [--steps N] [--tokens T (per sequence)] [--lr LR] [--out DIR]
#include <seqpar/seqpar.hpp>
#include <seqpar/train/all_reduce.hpp>
#include <seqpar/train/loss.hpp>
#include <seqpar/train/shard.hpp>
#include <seqpar/train/token_meta.hpp>
#include <seqpar_testing/adamw.hpp>
#include <seqpar_testing/tiny_transformer.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <random>
#include <string>
#include <vector>

using namespace seqpar;
using HybridRing = Strategy<partition::Hybrid, comm::Ring>;
using BaspRing = Strategy<partition::BatchAware<partition::Zigzag>, comm::Ring>;
constexpr int kRanks = 4;
constexpr int kSequences = 2;

namespace {

// One step's packed batch and its token ids (the same on every rank: each keeps only its shard).
struct Batch {
  DocumentBatch documents;
  std::vector<int> ids;
};

// Document lengths from a Pareto tail (scale 4, alpha 1: median 8, a few documents of hundreds of
// tokens), each document's tokens from one of four rules next = (prev * a + b) mod vocab, with 10%
// random tokens. Deterministic in (step, seed).
Batch corpus(int step, std::int64_t tokens, int vocab) {
  std::mt19937_64 rng(0x5eed0000u + static_cast<std::uint64_t>(step));
  const auto uniform = [&] { return static_cast<double>(rng() >> 11) * 0x1.0p-53; };
  constexpr int kA[4] = {1, 3, 5, 7}, kB[4] = {1, 7, 11, 13};
  std::vector<std::vector<std::int64_t>> seqs(kSequences);
  Batch b;
  for (auto& docs : seqs)
    for (std::int64_t left = tokens; left > 0; left -= docs.back())
      docs.push_back(std::clamp<std::int64_t>(std::llround(4.0 / (1.0 - uniform())), 2, left));
  b.documents = DocumentBatch(seqs);
  for (const Document& d : b.documents.documents()) {
    const int rule = static_cast<int>(rng() % 4);
    int prev = static_cast<int>(rng() % static_cast<std::uint64_t>(vocab));
    for (std::int64_t t = d.tokens.begin; t < d.tokens.end; ++t) {
      b.ids.push_back(prev);
      prev = uniform() < 0.1 ? static_cast<int>(rng() % static_cast<std::uint64_t>(vocab))
                             : (prev * kA[rule] + kB[rule]) % vocab;
    }
  }
  return b;
}

struct Setup {
  testing::TinyConfig model{};
  testing::AdamW<float>::Arguments adamw{.lr = 1e-2, .weight_decay = 0.01};
  int steps = 50;
  std::int64_t tokens = 512;  // per sequence
};

struct Run {
  std::vector<double> loss;  // per step: the batch's mean loss (rank 0's; every rank has the same)
  std::vector<float> params;
  double seconds = 0;
};

// Trains on `ranks` in-process ranks with strategy S; every rank runs this same loop on its rows.
template <class S>
Run train_on(int ranks, const typename S::Arguments& args, const Setup& setup) {
  Run out;
  const auto t0 = std::chrono::steady_clock::now();
  backend::inproc::World(ranks).run([&](backend::inproc::Transport& t) {
    testing::TinyTransformer<float> model(setup.model);
    model.init(2026);  // the same initial parameters on every rank and in every run
    testing::AdamW<float> adamw(model.num_params(), setup.adamw);
    DistributedAttention<S, attention::CpuFlash<float>> attn(
        t, setup.model.attention_shape(), args, attention::CpuFlash<float>(attention::CpuFlashArguments{}));
    const int dim = setup.model.dim, layers = setup.model.layers;
    std::vector<testing::TinyTransformer<float>::LayerCache> caches(static_cast<std::size_t>(layers));
    std::vector<float> grads(model.num_params());
    for (int step = 0; step < setup.steps; ++step) {
      const Batch b = corpus(step, setup.tokens, setup.model.vocab);
      const DocumentBatch& batch = b.documents;
      const ShardPlan& plan = attn.plan(batch);
      // What this rank holds: its rows' ids, positions within their documents, next-token labels.
      const train::TokenMeta meta = train::token_meta(batch, plan, t.rank());
      const auto n = static_cast<std::size_t>(meta.rows());
      std::vector<int> ids(n);
      train::shard(batch, plan, t.rank(), std::span<const int>(b.ids), std::span(ids));
      const std::vector<int> labels = train::labels(t, plan, meta, std::span<const int>(ids), -1);
      const std::span<const std::int64_t> positions(meta.position);
      const auto attend = [&](auto q, auto k, auto v, auto o, auto lse) { attn.forward(batch, q, k, v, o, lse); };
      const auto attend_backward = [&](auto q, auto k, auto v, auto o, auto lse, auto dout, auto dq, auto dk, auto dv) {
        attn.backward(batch, q, k, v, o, lse, dout, dq, dk, dv);
      };
      // Forward: embedding, layers (attention across ranks through `attend`).
      std::vector<float> h(n * static_cast<std::size_t>(dim)), next(h.size()), dh(h.size()), dx(h.size());
      model.embed(ids, h);
      for (int l = 0; l < layers; ++l) {
        model.layer_forward(l, h, positions, attend, caches[static_cast<std::size_t>(l)], next);
        std::swap(h, next);
      }
      // Loss: mean over the batch's label tokens, on every rank; the gradient scale is 1 / their count.
      const train::LossTotals count = train::combine(t, train::LossTotals{0.0, meta.label_count});
      std::fill(grads.begin(), grads.end(), 0.f);
      const float sum = model.head(h, labels, static_cast<float>(count.gradient_scale()), dh, grads);
      const train::LossTotals loss = train::combine(t, train::LossTotals{sum, meta.label_count});
      // Backward through the layers, then the embedding; gradients summed over the ranks.
      for (int l = layers - 1; l >= 0; --l) {
        model.layer_backward(l, caches[static_cast<std::size_t>(l)], positions, dh, attend_backward, dx, grads);
        std::swap(dh, dx);
      }
      model.embed_backward(ids, dh, grads);
      train::all_reduce_sum(t, std::span(grads));
      adamw.step(model.params(), grads);
      if (t.rank() == 0) out.loss.push_back(loss.mean());
    }
    if (t.rank() == 0) out.params.assign(model.params().begin(), model.params().end());
  });
  out.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return out;
}

double max_rel_loss(const Run& a, const Run& ref) {
  double e = 0;
  for (std::size_t i = 0; i < ref.loss.size(); ++i) e = std::max(e, std::abs(a.loss[i] - ref.loss[i]) / ref.loss[i]);
  return e;
}
double max_rel_params(const Run& a, const Run& ref) {
  double e = 0, s = 0;
  for (std::size_t i = 0; i < ref.params.size(); ++i) {
    e = std::max(e, std::abs(double(a.params[i]) - double(ref.params[i])));
    s = std::max(s, std::abs(double(ref.params[i])));
  }
  return e / s;
}

// The loss curves as an SVG line chart (steps on x, loss on y; the runs overlap when they agree).
void write_svg(const std::string& path, const std::vector<const Run*>& runs, const std::vector<std::string>& names) {
  constexpr double kW = 640, kH = 360, kL = 60, kR = 20, kT = 30, kB = 40;
  double lo = 1e300, hi = -1e300;
  for (const Run* r : runs)
    for (double l : r->loss) lo = std::min(lo, l), hi = std::max(hi, l);
  const double span = std::max(hi - lo, 1e-9);
  const auto steps = runs.front()->loss.size();
  const auto x = [&](std::size_t i) {
    return kL + (kW - kL - kR) * double(i) / double(std::max<std::size_t>(steps - 1, 1));
  };
  const auto y = [&](double l) { return kT + (kH - kT - kB) * (hi - l) / span; };
  std::ofstream f(path);
  f << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << kW << "\" height=\"" << kH
    << "\" font-family=\"sans-serif\" font-size=\"12\">\n"
    << "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n"
    << "<text x=\"" << kL << "\" y=\"18\">seqpar 09: tiny decoder, mean cross-entropy per step</text>\n"
    << "<line x1=\"" << kL << "\" y1=\"" << kH - kB << "\" x2=\"" << kW - kR << "\" y2=\"" << kH - kB
    << "\" stroke=\"black\"/>\n"
    << "<line x1=\"" << kL << "\" y1=\"" << kT << "\" x2=\"" << kL << "\" y2=\"" << kH - kB
    << "\" stroke=\"black\"/>\n";
  for (int k = 0; k <= 4; ++k) {
    const double l = lo + span * k / 4;
    f << "<text x=\"4\" y=\"" << y(l) + 4 << "\">" << std::to_string(l).substr(0, 5) << "</text>\n";
  }
  f << "<text x=\"" << kW / 2 << "\" y=\"" << kH - 10 << "\">step (0.." << steps - 1 << ")</text>\n";
  const char* colors[] = {"black", "#d62728", "#1f77b4"};
  const char* dashes[] = {"", "6,4", "2,4"};
  for (std::size_t r = 0; r < runs.size(); ++r) {
    f << "<polyline fill=\"none\" stroke=\"" << colors[r % 3] << "\" stroke-width=\"1.5\" stroke-dasharray=\""
      << dashes[r % 3] << "\" points=\"";
    for (std::size_t i = 0; i < steps; ++i) f << x(i) << ',' << y(runs[r]->loss[i]) << ' ';
    f << "\"/>\n<text x=\"" << kW - 260 << "\" y=\"" << kT + 16 * (r + 1) << "\" fill=\"" << colors[r % 3] << "\">"
      << names[r] << "</text>\n";
  }
  f << "</svg>\n";
}

}  // namespace

int main(int argc, char** argv) {
  Setup setup;
  std::string out_dir = ".";
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--smoke") {
      setup.tokens = 128;
    } else if (a == "--steps" && i + 1 < argc) {
      setup.steps = std::stoi(argv[++i]);
    } else if (a == "--tokens" && i + 1 < argc) {
      setup.tokens = std::stoll(argv[++i]);
    } else if (a == "--lr" && i + 1 < argc) {
      setup.adamw.lr = std::stod(argv[++i]);
    } else if (a == "--out" && i + 1 < argc) {
      out_dir = argv[++i];
    } else {
      std::fprintf(stderr, "unknown argument %s\n", a.c_str());
      return 2;
    }
  }
  const testing::TinyConfig& c = setup.model;
  std::printf(
      "seqpar 09: tiny decoder (%d layers, dim %d, heads %d:%d, head_dim %d, ffn %d, vocab %d; fp32) trained with "
      "AdamW for %d steps on %d sequences x %lld tokens of packed long-tail documents\n",
      c.layers, c.dim, c.heads_q, c.heads_kv, c.head_dim, c.ffn, c.vocab, setup.steps, kSequences,
      static_cast<long long>(setup.tokens));
  HybridRing::Arguments hybrid_args;
  hybrid_args.comm.sharding_aware = true;
  BaspRing::Arguments basp_args;
  basp_args.partition.group_size = kRanks / 2;  // 2 groups of 2 ranks, one sequence each
  basp_args.comm.sharding_aware = true;

  const Run single = train_on<HybridRing>(1, hybrid_args, setup);
  const Run hybrid = train_on<HybridRing>(kRanks, hybrid_args, setup);
  const Run basp = train_on<BaspRing>(kRanks, basp_args, setup);

  const double tokens = double(setup.steps) * kSequences * double(setup.tokens);
  const struct {
    const char* name;
    const Run* run;
  } rows[] = {{"1 rank (reference)", &single},
              {"4 ranks, Hybrid x sharding-aware Ring", &hybrid},
              {"4 ranks, BASP (2 groups) x sharding-aware Ring", &basp}};
  std::printf("%-48s %12s %12s %14s %14s\n", "run", "tokens/s", "final loss", "max loss err", "params err");
  bool ok = true;
  for (const auto& r : rows) {
    const double le = max_rel_loss(*r.run, single), pe = max_rel_params(*r.run, single);
    std::printf("%-48s %12.0f %12.5f %14.2e %14.2e\n", r.name, tokens / r.run->seconds, r.run->loss.back(), le, pe);
    // fp32: only the order of sums differs between the runs. Parameters get 5e-5: AdamW's update m / (sqrt(v) + eps)
    // is about lr = 1e-2 whatever the gradient's size, so a component whose gradient is at fp32's rounding level
    // moves by up to lr per step in either run (1-rank vs 4-rank, --smoke: 0.7-1.4e-5 by instruction set; a
    // wrong gradient moves the loss and the parameters by orders of magnitude more).
    ok = ok && le < 1e-5 && pe < 5e-5;
  }
  std::printf("loss: step 0 %.4f -> step %d %.4f (uniform guess: ln %d = %.4f)\n", single.loss.front(), setup.steps - 1,
              single.loss.back(), c.vocab, std::log(double(c.vocab)));
  ok = ok && single.loss.back() < single.loss.front();

  const std::string csv = out_dir + "/09_train_tiny_loss.csv", svg = out_dir + "/09_train_tiny_loss.svg";
  std::ofstream f(csv);
  f << "step,loss_1_rank,loss_hybrid_ring_4_ranks,loss_basp_ring_4_ranks\n";
  for (int s = 0; s < setup.steps; ++s) {
    const auto i = static_cast<std::size_t>(s);
    char line[128];
    std::snprintf(line, sizeof line, "%d,%.9g,%.9g,%.9g\n", s, single.loss[i], hybrid.loss[i], basp.loss[i]);
    f << line;
  }
  write_svg(svg, {&single, &hybrid, &basp}, {rows[0].name, rows[1].name, rows[2].name});
  std::printf("wrote %s and %s\n", csv.c_str(), svg.c_str());
  std::printf("%s\n", ok ? "OK" : "FAILED: a 4-rank run differs from the 1-rank run (or the loss did not fall)");
  return ok ? 0 : 1;
}
