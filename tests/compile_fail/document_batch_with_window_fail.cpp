// SPDX-License-Identifier: Apache-2.0
// The old recipe for a window layer: a window on the batch moved where tokens live (issue 37). It must not
// compile, and the message must say what to write instead.
// expect: DocumentBatch::with_window is gone: a mask is per call, not per batch. Pass
//         AttentionMask::sliding_window(w) to DistributedAttention::forward/backward
#include <seqpar/core/document_batch.hpp>

int main() {
  const seqpar::DocumentBatch batch({{128, 64}});
  const seqpar::DocumentBatch windowed = batch.with_window(16);
  (void)windowed;
}
