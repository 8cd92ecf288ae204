// SPDX-License-Identifier: Apache-2.0
// A batch-level scheduler in Strategy's third slot, where a step-order policy belongs.
// expect: Strategy<P, C, Order>: Order must be a step-order policy (runtime::StaticOrder); batch-level
//         schedulers such as schedule::DynamicChunk sit above DistributedAttention, not inside a Strategy
#include <seqpar/comm/ring.hpp>
#include <seqpar/partition/zigzag.hpp>
#include <seqpar/strategy.hpp>

struct MyBatchScheduler {};

int main() {
  using S = seqpar::Strategy<seqpar::partition::Zigzag, seqpar::comm::Ring, MyBatchScheduler>;
  S::Arguments args;
  (void)args;
}
