"""The autograder's caps on every multi-rank check: --check-timeout and --check-memory-limit-gb.

The grader passes them to each kernel in the environment; run_on_ranks lowers a check's own
timeout and memory limit to them (never raises them), so a hang or a runaway rank costs less.
"""

import sys
import time

import cloudpickle
import pytest
import torch

from zerokit.grading.harness import MEMORY_ENV, TIMEOUT_ENV, CheckFailed, run_on_ranks

pytestmark = pytest.mark.distributed

cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _hoard(rank, world_size):
    """Rank 1 allocates without bound."""
    copies = []
    while rank == 1:
        copies.append(torch.ones(2**24))


def _sleep(rank, world_size):
    time.sleep(60)


@pytest.mark.timeout(60)
def test_the_memory_cap_stops_a_runaway_rank_at_the_cap(monkeypatch):
    monkeypatch.setenv(MEMORY_ENV, "0.75")
    with pytest.raises(CheckFailed, match=r"out of memory on 1 of 2 ranks: rank 1: used .* over the 0.75 GiB limit"):
        run_on_ranks(_hoard, 2, timeout=40)


@pytest.mark.timeout(60)
def test_the_timeout_cap_lowers_a_check_timeout_and_never_raises_it(monkeypatch):
    monkeypatch.setenv(TIMEOUT_ENV, "3")
    t0 = time.monotonic()
    with pytest.raises(CheckFailed, match="did not finish within 3 s"):
        run_on_ranks(_sleep, 2, timeout=40)
    assert time.monotonic() - t0 < 20
    monkeypatch.setenv(TIMEOUT_ENV, "100")
    with pytest.raises(CheckFailed, match="did not finish within 2 s"):
        run_on_ranks(_sleep, 2, timeout=2)
