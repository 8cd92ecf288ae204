// SPDX-License-Identifier: Apache-2.0
// Hierarchical with its levels the wrong way round (ring inside the node, all-to-all across nodes).
// expect: Hierarchical is implemented as Hierarchical<AllToAll, Ring>: all-to-all inside a node,
//         ring across nodes
#include <seqpar/comm/hierarchical.hpp>

int main() {
  seqpar::comm::Hierarchical<seqpar::comm::Ring, seqpar::comm::AllToAll> usp;
  (void)usp;
}
