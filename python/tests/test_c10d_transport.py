# SPDX-License-Identifier: Apache-2.0
"""The shared transport cases (tests/support/transport_cases.hpp) on seqpar's c10d transport, gloo."""
import os
import signal
import time

import pytest

from dist_util import run


def _cases(rank, world, strategies):
    import torch.distributed as dist
    from seqpar import _transport_cases

    failures, accepted = _transport_cases.run(dist.group.WORLD, strategies=strategies, timeout_s=60.0)
    return failures, accepted


@pytest.mark.parametrize("world", [2, 3, 4])
def test_transport_cases(world):
    # Strategies run on 2 and 4 ranks (every one of them accepts those); on 3 the transport cases only.
    strategies = world != 3
    results = run(_cases, world, strategies, timeout=240)
    for rank, (failures, accepted) in enumerate(results):
        assert failures == [], f"rank {rank}: " + "\n".join(failures)
        if strategies:
            assert accepted == 7, f"rank {rank}: {accepted} of 7 transport strategies ran"


def _silent(rank, world):
    import torch.distributed as dist
    from seqpar import _transport_cases

    if rank == 1:
        time.sleep(2.0)  # never sends; stays alive past the receiver's deadline
        return None
    start = time.monotonic()
    code, what = _transport_cases.recv_from_silent_peer(dist.group.WORLD, 1, 0.5)
    return code, what, time.monotonic() - start


def test_receive_times_out():
    code, what, took = run(_silent, 2)[0]
    assert code == 2, what  # Errc::kTimeout
    assert "rank 0" in what and "rank 1" in what, what
    assert took < 1.5


def _killed(rank, world):
    import torch.distributed as dist
    from seqpar import _transport_cases

    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)  # dies without a word
    start = time.monotonic()
    code, what = _transport_cases.recv_from_silent_peer(dist.group.WORLD, 1, 10.0)
    return code, what, time.monotonic() - start


def test_dead_peer_raises():
    code, what, took = run(_killed, 2, expect_dead=(1,), timeout=60)[0]
    # A closed connection is Errc::kPeerFailed; if the transport only notices at its deadline, kTimeout.
    assert code in (1, 2), what
    assert took < 10.5, what
