// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

#include <algorithm>
#include <cctype>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "seqpar/core/attention_shape.hpp"
#include "seqpar/core/error.hpp"

namespace seqpar::plan {

/// A decoder-only transformer as the cost model sees it: pre-norm attention with GQA and a SwiGLU MLP.
/// Query/key and value heads may differ in size (MLA-shaped attention: head_dim 192, head_dim_v 128):
/// Q and K have head_dim values per head, V and the attention output head_dim_v (0: head_dim).
///
///     plan::ModelShape m{"mla", 4, 2048, 16, 16, 192, 8192, 32000, false, 128};
struct ModelShape {
  std::string name;
  int layers = 0;
  int hidden = 0;
  int heads_q = 0;
  int heads_kv = 0;
  int head_dim = 0;
  int ffn = 0;
  int vocab = 0;
  bool tied_embeddings = false;
  int head_dim_v = 0;  ///< value and attention-output head size; 0 means head_dim

  [[nodiscard]] AttentionShape attention() const {
    return AttentionShape{heads_q, heads_kv, head_dim, 0.0, head_dim_v};
  }

  /// Values one token has in each attention tensor: Q (Hq x d_qk), K (Hkv x d_qk), V (Hkv x d_v) and the
  /// attention output O (Hq x d_v), d_v = attention().v_dim().
  struct AttentionWidths {
    double q = 0, k = 0, v = 0, o = 0;
  };
  [[nodiscard]] AttentionWidths attention_widths() const noexcept {
    const AttentionShape s = attention();
    const double dqk = s.qk_dim(), dv = s.v_dim();
    return {heads_q * dqk, heads_kv * dqk, heads_kv * dv, heads_q * dv};
  }

  /// Weights of one layer: Q, K and V projections (hidden x each of attention_widths' q, k, v), the output
  /// projection (o x hidden), gate/up/down (3 x hidden x ffn), two norms.
  [[nodiscard]] double layer_params() const noexcept {
    const double h = hidden;
    const AttentionWidths w = attention_widths();
    return h * (w.q + w.k + w.v + w.o) + 3.0 * h * ffn + 2.0 * h;
  }
  [[nodiscard]] double embedding_params() const noexcept {
    return static_cast<double>(vocab) * hidden * (tied_embeddings ? 1.0 : 2.0);
  }
  [[nodiscard]] double params() const noexcept { return layers * layer_params() + embedding_params(); }
  /// Forward GEMM FLOPs of one layer per token (2 per multiply-add): everything but attention itself.
  [[nodiscard]] double layer_gemm_flops_per_token() const noexcept { return 2.0 * (layer_params() - 2.0 * hidden); }
  /// One named tensor a layer keeps for its backward, in bytes per token (see layer_activation_terms).
  struct ActivationTerm {
    const char* name;
    double bytes_per_token;
  };
  /// The tensors one layer keeps per token for its backward without checkpointing, activations of
  /// `value_bytes` and per-row statistics of `stat_bytes` (fp32 in mixed precision). The accounting is
  /// Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models", section
  /// 4.1: every input a backward GEMM or norm needs is kept) for a LLaMA block: RMSNorm instead of
  /// LayerNorm (its input, output and one inverse-RMS per row), SwiGLU instead of GeLU (gate, up and
  /// their product feed the backward), no dropout masks, and FlashAttention (Dao et al. 2022), which
  /// keeps Q, K, V, the output and one log-sum-exp per query head instead of the s^2 softmax.
  /// A checkpointed layer keeps only its input (hidden x value_bytes).
  [[nodiscard]] std::vector<ActivationTerm> layer_activation_terms(double value_bytes, double stat_bytes = 4) const {
    const double h = hidden, f = ffn;
    const AttentionWidths w = attention_widths();
    return {{"attention norm input (residual stream)", value_bytes * h},
            {"attention norm output (Q/K/V GEMM input)", value_bytes * h},
            {"Q (after RoPE)", value_bytes * w.q},
            {"K, V (after RoPE)", value_bytes * (w.k + w.v)},
            {"attention output O (O-projection input)", value_bytes * w.o},
            {"softmax log-sum-exp, one per query head", stat_bytes * heads_q},
            {"MLP norm input (residual stream)", value_bytes * h},
            {"MLP norm output (gate/up GEMM input)", value_bytes * h},
            {"norm statistics, one per norm", stat_bytes * 2.0},
            {"MLP gate and up projections", value_bytes * 2.0 * f},
            {"SwiGLU product (down GEMM input)", value_bytes * f}};
  }
  /// The sum of layer_activation_terms.
  [[nodiscard]] double layer_activation_bytes_per_token(double value_bytes, double stat_bytes = 4) const {
    double b = 0;
    for (const ActivationTerm& t : layer_activation_terms(value_bytes, stat_bytes)) b += t.bytes_per_token;
    return b;
  }

  void validate(const char* where = "ModelShape") const {
    detail::require(layers > 0, where, "layers", layers, "must be positive");
    detail::require(hidden > 0, where, "hidden", hidden, "must be positive");
    detail::require(ffn > 0, where, "ffn", ffn, "must be positive");
    detail::require(vocab >= 0, where, "vocab", vocab, "must be >= 0");
    attention().validate(where);
  }
};

namespace models {

// Shapes from the models' published config.json files (Hugging Face hub) and the LLaMA paper (Table 2).
[[nodiscard]] inline ModelShape llama31_8b() {
  return {"llama-3.1-8b", 32, 4096, 32, 8, 128, 14336, 128256, false};
}
[[nodiscard]] inline ModelShape llama32_1b() {
  return {"llama-3.2-1b", 16, 2048, 32, 8, 64, 8192, 128256, true};
}
[[nodiscard]] inline ModelShape llama32_3b() {
  return {"llama-3.2-3b", 28, 3072, 24, 8, 128, 8192, 128256, true};
}
[[nodiscard]] inline ModelShape qwen15_1_8b() {
  return {"qwen1.5-1.8b", 24, 2048, 16, 16, 128, 5504, 151936, false};
}
[[nodiscard]] inline ModelShape qwen25_3b() {
  return {"qwen2.5-3b", 36, 2048, 16, 2, 128, 11008, 151936, true};
}
[[nodiscard]] inline ModelShape llama_7b() {
  return {"llama-7b", 32, 4096, 32, 32, 128, 11008, 32000, false};
}
[[nodiscard]] inline ModelShape llama_13b() {
  return {"llama-13b", 40, 5120, 40, 40, 128, 13824, 32000, false};
}
[[nodiscard]] inline ModelShape llama_30b() {
  return {"llama-30b", 60, 6656, 52, 52, 128, 17920, 32000, false};
}

/// DeepSeek-V3's attention (MLA) and dense-layer shapes (its config.json on the Hugging Face hub,
/// deepseek-ai/DeepSeek-V3: 61 layers, hidden_size 7168, 128 attention and key/value heads, q/k head
/// 192 = qk_nope_head_dim 128 + qk_rope_head_dim 64, v_head_dim 128, intermediate_size 18432, vocab_size
/// 129280, untied embeddings), with every layer taken as dense and its Q/K/V projections as full-rank:
/// ModelShape has neither the low-rank query and KV compression (q_lora_rank 1536, kv_lora_rank 512) nor
/// the MoE layers, so params() (61.85e9) is not the published 671e9. For planning MLA-sized attention.
[[nodiscard]] inline ModelShape deepseek_v3_dense() {
  return {"deepseek-v3-dense", 61, 7168, 128, 128, 192, 18432, 129280, false, 128};
}

[[nodiscard]] inline std::vector<ModelShape> all() {
  return {llama31_8b(), llama32_1b(), llama32_3b(), qwen15_1_8b(),      qwen25_3b(),
          llama_7b(),   llama_13b(),  llama_30b(),  deepseek_v3_dense()};
}

/// The named model (case-insensitive). Throws naming the name and listing the known ones.
[[nodiscard]] inline ModelShape by_name(std::string_view name) {
  std::string n(name);
  std::transform(n.begin(), n.end(), n.begin(), [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  std::string known;
  for (const ModelShape& m : all()) {
    if (m.name == n) return m;
    known += (known.empty() ? "" : ", ") + m.name;
  }
  seqpar::detail::throw_invalid("plan::models::by_name", "name", std::string(name),
                                "is not a known model (" + known + ")");
}

}  // namespace models
}  // namespace seqpar::plan
