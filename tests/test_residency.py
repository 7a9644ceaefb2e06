"""Residency policies on synthetic page counts, without a model."""

from __future__ import annotations

import pytest

from policies.residency import NewestResident, SinkAndNewest


@pytest.mark.parametrize("n_pages, capacity", [(0, 4), (1, 4), (3, 4), (4, 4), (10, 4), (10, 1), (300, 97)])
def test_newest_keeps_the_tail(n_pages, capacity):
    got = list(NewestResident().resident(n_pages, capacity))
    assert got == list(range(max(0, n_pages - capacity), n_pages))


@pytest.mark.parametrize("n_pages, capacity, sinks, want", [
    (10, 4, 1, [0, 7, 8, 9]),
    (10, 4, 2, [0, 1, 8, 9]),
    (3, 4, 1, [0, 1, 2]),        # everything fits
    (10, 1, 1, [9]),             # the tail page always gets the slot
    (10, 3, 5, [0, 1, 9]),       # sinks never take the last slot
])
def test_sink_and_newest(n_pages, capacity, sinks, want):
    got = SinkAndNewest(sinks).resident(n_pages, capacity)
    assert got == want and len(got) <= capacity and (n_pages - 1) in got
