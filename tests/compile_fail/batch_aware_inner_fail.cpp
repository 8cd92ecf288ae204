// SPDX-License-Identifier: Apache-2.0
// BatchAware over something that is not a partitioner.
// expect: BatchAware<Inner>: Inner must be a Partitioner constructible as Inner{Inner::Arguments}
#include <seqpar/partition/batch_aware.hpp>

struct NotAPartitioner {};

int main() {
  seqpar::partition::BatchAware<NotAPartitioner> basp;
  (void)basp;
}
