// SPDX-License-Identifier: Apache-2.0
// seqpar._transport_cases: runs the transport cases every transport runs
// (tests/support/transport_cases.hpp) on seqpar::backend::c10d::Transport over a torch.distributed
// process group. Test-only: python/tests/test_c10d_transport.py calls it on gloo in real processes.
#include <torch/extension.h>

#include <seqpar/backend/c10d/transport.hpp>

#include <chrono>
#include <string>
#include <vector>

#include "support/transport_cases.hpp"

namespace {

// Runs every transport case and, when `strategies`, every transport strategy (fp64, 1e-10 against the
// reference) over `group`. Returns this rank's failed expectations (empty: all passed) and the number
// of strategies the topology accepted.
std::pair<std::vector<std::string>, int> run(const c10::intrusive_ptr<::c10d::ProcessGroup>& group, bool strategies,
                                             double timeout_s) {
  seqpar::backend::c10d::Transport::Options options;
  options.timeout = seqpar::detail::timeout_from_seconds("_transport_cases", "timeout_s", timeout_s);
  seqpar::backend::c10d::Transport t(group, options);
  seqpar::test::Failures failures;
  int accepted = 0;
  {
    pybind11::gil_scoped_release release;  // gloo's threads never need it; peers' Python keeps running
    seqpar::test::all_transport_cases(t, failures);
    if (strategies) accepted = seqpar::test::all_strategy_cases(t, failures);
  }
  return {failures.messages(), accepted};
}

// A receive whose peer never sends: must raise seqpar's timeout (Errc::kTimeout) within `timeout_s`.
// Returns the error's code and message.
std::pair<int, std::string> recv_from_silent_peer(const c10::intrusive_ptr<::c10d::ProcessGroup>& group, int peer,
                                                  double timeout_s) {
  seqpar::backend::c10d::Transport::Options options;
  options.timeout = seqpar::detail::timeout_from_seconds("_transport_cases", "timeout_s", timeout_s);
  seqpar::backend::c10d::Transport t(group, options);
  std::vector<std::byte> buf(16);
  pybind11::gil_scoped_release release;
  try {
    t.recv(std::span<std::byte>(buf), peer, 7);
  } catch (const seqpar::Error& e) {
    return {static_cast<int>(e.errc()), e.what()};
  }
  return {0, "no error"};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "seqpar transport cases over torch.distributed (tests only)";
  m.def("run", &run, pybind11::arg("group"), pybind11::arg("strategies") = true, pybind11::arg("timeout_s") = 60.0);
  m.def("recv_from_silent_peer", &recv_from_silent_peer, pybind11::arg("group"), pybind11::arg("peer"),
        pybind11::arg("timeout_s"));
}
