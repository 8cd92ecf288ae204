// SPDX-License-Identifier: Apache-2.0
// A partitioner whose Arguments do not name their fields: the ranks could not agree on `cut`.
// expect: a policy's Arguments must name their fields for the cross-rank agreement: give the struct a
//         member `template <class Fn> void for_each_argument(Fn&& fn) const` that calls fn("field", field)
//         for every field (an empty body when it has none)
#include <seqpar/comm/ring.hpp>
#include <seqpar/partition/zigzag.hpp>
#include <seqpar/strategy.hpp>

struct Cut : seqpar::partition::Zigzag {
  struct Arguments {
    int cut = 0;
  };
  Arguments args;
};
static_assert(seqpar::partition::Partitioner<Cut>);

int main() {
  using S = seqpar::Strategy<Cut, seqpar::comm::Ring>;
  S::Arguments args;
  (void)args;
}
