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

  [[nodiscard]] AttentionShape attention() const { return AttentionShape{heads_q, heads_kv, head_dim, 0.0}; }

  /// Weights of one layer: Q and O (hidden x Hq*d), K and V (hidden x Hkv*d), gate/up/down (3 x hidden x
  /// ffn), two norms.
  [[nodiscard]] double layer_params() const noexcept {
    const double h = hidden, q = static_cast<double>(heads_q) * head_dim, kv = static_cast<double>(heads_kv) * head_dim;
    return 2.0 * h * q + 2.0 * h * kv + 3.0 * h * ffn + 2.0 * h;
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
    const double h = hidden, q = static_cast<double>(heads_q) * head_dim, kv = static_cast<double>(heads_kv) * head_dim,
                 f = ffn;
    return {{"attention norm input (residual stream)", value_bytes * h},
            {"attention norm output (Q/K/V GEMM input)", value_bytes * h},
            {"Q (after RoPE)", value_bytes * q},
            {"K, V (after RoPE)", value_bytes * 2.0 * kv},
            {"attention output O (O-projection input)", value_bytes * q},
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

[[nodiscard]] inline std::vector<ModelShape> all() {
  return {llama31_8b(), llama32_1b(), llama32_3b(), qwen15_1_8b(), qwen25_3b(), llama_7b(), llama_13b(), llama_30b()};
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
