// SPDX-License-Identifier: Apache-2.0
// The README's recipes, compiled and run as written: the text between each "BEGIN README" and
// "END README" marker below is the README's code block of that name, byte for byte
// (tests/docs_recipes.cmake, test docs.readme_recipes, compares them), and the test cases here run it
// on every strategy the README claims it for, against the fp64 reference.
#include <doctest/doctest.h>

#include <seqpar/seqpar.hpp>

#include <cstdint>
#include <mutex>
#include <random>
#include <vector>

#include "support/distributed_check.hpp"
#include "support/strategy_list.hpp"

namespace recipe {
using namespace seqpar;

// BEGIN README: mixed-masks
// A model of 12 full and 12 sliding-window layers (window 128): one attention object, one set of rows.
template <class S>  // any Strategy: every partitioner x communicator
struct MixedModel {
  static constexpr int kLayers = 24;
  static constexpr AttentionMask kWindow = {128};  // AttentionMask::sliding_window(128)

  MixedModel(backend::inproc::Transport& transport, AttentionShape shape, typename S::Arguments args = {})
      : attn(transport, shape, declare_masks(args)) {}

  static typename S::Arguments declare_masks(typename S::Arguments a) {
    a.masks = {{AttentionMask::causal(), kLayers / 2}, {kWindow, kLayers / 2}};  // what the rows are balanced for
    return a;
  }
  static AttentionMask mask_of(int layer) { return layer % 2 == 1 ? kWindow : AttentionMask::causal(); }

  // The rank's rows for the whole model: the same for every layer, whatever its mask.
  const std::vector<Range>& rows(const DocumentBatch& batch) { return attn.owned_ranges(batch); }

  void attention_forward(int layer, const DocumentBatch& batch, ThdView<const double> q, ThdView<const double> k,
                         ThdView<const double> v, ThdView<double> o, LseView<double> lse) {
    attn.forward(batch, mask_of(layer), q, k, v, o, lse);
  }
  void attention_backward(int layer, const DocumentBatch& batch, ThdView<const double> q, ThdView<const double> k,
                          ThdView<const double> v, ThdView<const double> o, LseView<const double> lse,
                          ThdView<const double> dout, ThdView<double> dq, ThdView<double> dk, ThdView<double> dv) {
    attn.backward(batch, mask_of(layer), q, k, v, o, lse, dout, dq, dk, dv);
  }

  DistributedAttention<S, attention::Reference<double>> attn;
};
// END README

}  // namespace recipe

using namespace seqpar;

TEST_SUITE("strategy") {
  TEST_CASE("README recipe: a model mixing window and full layers, on every partitioner x communicator") {
    // The recipe's window of 128 over documents longer than it; four of its layers (two of each kind)
    // on the same rows per rank, each against the fp64 reference of its mask.
    std::mt19937 rng(12);
    std::vector<std::int64_t> docs = test::lognormal_docs(150, 20.0, 1.0, rng);
    docs.push_back(300);
    const DocumentBatch batch({docs, test::lognormal_docs(120, 30.0, 1.0, rng)});
    const AttentionShape shape{4, 2, 8};
    int runs = 0;
    test::for_each_combination([&]<class C>(C) {  // under a sanitizer: strategy_list.hpp's sanitizer sweep
      using S = typename C::strategy;
      using Model = recipe::MixedModel<S>;
      constexpr int world = 4;
      const auto args = Model::declare_masks(C::arguments());
      if (!S::can_implement(args, batch, shape, Topology{world, world}).ok ||
          !S::can_implement(args, batch, shape, Topology{world, world}, Model::kWindow).ok)
        return;
      INFO(C::name());
      std::vector<std::unique_ptr<test::detail::WholeBatch>> whole;
      for (int l = 0; l < 4; ++l)
        whole.push_back(std::make_unique<test::detail::WholeBatch>(batch, Model::mask_of(l), shape, 40u + l,
                                                                   std::type_identity<test::HostStorage>{},
                                                                   std::type_identity<double>{}));
      std::mutex mu;
      test::HostStorage::run(world, [&](backend::inproc::Transport& t) {
        Model model(t, shape, C::arguments());
        const std::vector<Range> rows = model.rows(batch);
        const std::int64_t n = model.attn.local_tokens(batch);
        std::vector<std::unique_ptr<test::detail::Shard<attention::Reference<double>, test::HostStorage>>> s;
        for (int l = 0; l < 4; ++l) {
          s.push_back(std::make_unique<test::detail::Shard<attention::Reference<double>, test::HostStorage>>(
              *whole[static_cast<std::size_t>(l)], rows, n, model.attn.exec()));
          auto& x = *s.back();
          model.attention_forward(l, batch, x.view(x.q, 4), x.view(x.k, 2), x.view(x.v, 2), x.view(x.o, 4),
                                  x.lse_view());
        }
        for (int l = 3; l >= 0; --l) {
          auto& x = *s[static_cast<std::size_t>(l)];
          model.attention_backward(l, batch, x.view(x.q, 4), x.view(x.k, 2), x.view(x.v, 2), x.view(x.o, 4),
                                   LseView<const double>(x.lse_view()), x.view(x.dout, 4), x.view(x.dq, 4),
                                   x.view(x.dk, 2), x.view(x.dv, 2));
        }
        const std::lock_guard lock(mu);
        for (int l = 0; l < 4; ++l) s[static_cast<std::size_t>(l)]->scatter(rows, *whole[static_cast<std::size_t>(l)]);
      });
      for (int l = 0; l < 4; ++l) {
        test::Errors e;
        whole[static_cast<std::size_t>(l)]->errors(e);
        INFO("layer " << l);
        CHECK(e.max() < 1e-9);
      }
      ++runs;
    });
    MESSAGE(runs << " combinations ran the recipe");
    CHECK(runs >= 40 * static_cast<int>(test::kNumSweptCombinations) / static_cast<int>(test::kNumCombinations));
  }
}
