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


@pytest.mark.parametrize("policy", [NewestResident, lambda step: SinkAndNewest(1, step)])
@pytest.mark.parametrize("capacity, step", [(6, 1), (6, 3), (7, 5), (4, 9)])
def test_a_residency_step_changes_the_streamed_set_once_per_step_pages(policy, capacity, step):
    """The oldest resident pages leave ``step`` at a time: the streamed set changes once per
    ``step`` new pages, each change streaming ``step`` pages more (a step beyond the slots the
    newest pages share acts as that many); the resident set fits the pool and holds the newest
    page; step 1 is the plain policy."""
    p, streamed, changes = policy(step), [], 0
    room = capacity - (policy is not NewestResident)  # the sink policy keeps page 0 in one slot
    for n in range(1, 60):
        got = list(p.resident(n, capacity))
        assert len(got) <= capacity and (n - 1) in got and got == sorted(set(got))
        now = [q for q in range(n) if q not in got]
        if now != streamed:
            changes += 1
            assert len(now) - len(streamed) == min(step, room)
        streamed = now
    assert changes == -(-(59 - capacity) // min(step, room))  # the new pages once the pool is full, a step at a time
    if step == 1 and policy is NewestResident:
        assert all(list(p.resident(n, capacity)) == list(range(max(0, n - capacity), n)) for n in range(60))


def test_a_residency_step_below_one_is_refused():
    with pytest.raises(ValueError, match="residency step 0"):
        NewestResident(0)
