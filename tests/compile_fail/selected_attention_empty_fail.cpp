// SPDX-License-Identifier: Apache-2.0
// SelectedAttention to choose among no strategies at all.
// expect: SelectedAttention needs at least one strategy
#include <seqpar/attention/reference.hpp>
#include <seqpar/plan/selected_attention.hpp>

int main() {
  using Empty = seqpar::plan::SelectedAttention<seqpar::attention::Reference<double>>;
  return static_cast<int>(sizeof(Empty));
}
