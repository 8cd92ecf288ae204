// seqpar::glpk from an installed tree: DPP's checkpointing MILP on GLPK.
#include <seqpar/schedule/checkpoint_milp.hpp>

int main() {
  const auto solver = seqpar::schedule::milp_solver();
  return solver ? 0 : 1;
}
