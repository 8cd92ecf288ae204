// A user's program: include the installed headers (umbrella, facade, trainer glue, the model table),
// run a tiny reference attention, check it.
#include <seqpar/distributed_attention.hpp>
#include <seqpar/plan/model_shape.hpp>
#include <seqpar/seqpar.hpp>
#include <seqpar/train/all_reduce.hpp>
#include <seqpar/train/loss.hpp>
#include <seqpar/train/pipelined_step.hpp>
#include <seqpar/train/shard.hpp>
#include <seqpar/train/token_batch.hpp>
#include <seqpar/train/token_meta.hpp>

// The library's demo model (testing/seqpar_testing: TinyTransformer, AdamW, the pipelined step) is
// not installed: a trainer brings its own.
#if __has_include(<seqpar/train/tiny_transformer.hpp>) || __has_include(<seqpar_testing/tiny_transformer.hpp>)
#error "the demo model must not be installed"
#endif

#include <cmath>
#include <cstdio>

int main() {
  static_assert(sizeof(seqpar::plan::ModelShape) > 0);
  static_assert(!seqpar::train::PipelineStage<int>);  // the DPP runner's concept is installed (no tag: no stage)
  const auto batch = seqpar::DocumentBatch::single({3, 2});
  const seqpar::AttentionShape shape{2, 1, 4};
  seqpar::ThdTensor<double> q(batch.total_tokens(), 2, 4), k(batch.total_tokens(), 1, 4), v(batch.total_tokens(), 1, 4),
      o(batch.total_tokens(), 2, 4);
  for (std::size_t i = 0; i < v.storage.size(); ++i) v.storage[i] = 1.0;
  seqpar::LseTensor<double> lse(2, batch.total_tokens());
  const auto slices = batch.document_causal_slices();
  seqpar::attention::Reference<double>{}.forward(shape, q.view(), k.view(), v.view(), slices, o.view(), lse.view());
  // q = 0: uniform weights over the visible keys, so O = 1 and LSE = log(#keys) for every row.
  const bool ok = std::abs(o.storage[0] - 1.0) < 1e-12 && std::abs(lse.storage[2] - std::log(3.0)) < 1e-12;
  std::printf("%s\n", ok ? "consumer OK" : "consumer FAILED");
  return ok ? 0 : 1;
}
