// SPDX-License-Identifier: Apache-2.0
// schedule::Static (a batch-level scheduler) in Strategy's third slot, which takes a step order only.
// expect: Strategy<P, C, Order>: a batch-level scheduler (schedule::Static, schedule::DynamicChunk) is not a
//         step order; write runtime::StaticOrder (or leave the slot out), and run schedulers above
//         DistributedAttention
#include <seqpar/comm/ring.hpp>
#include <seqpar/partition/zigzag.hpp>
#include <seqpar/schedule/static.hpp>
#include <seqpar/strategy.hpp>

int main() {
  using S = seqpar::Strategy<seqpar::partition::Zigzag, seqpar::comm::Ring, seqpar::schedule::Static>;
  S::Arguments args;
  (void)args;
}
