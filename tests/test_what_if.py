"""What-if arena sizes (experiments/what_if.py) on the synthetic study of test_crossover, whose
crossover has a closed form: capacities shift by the pages the extra bytes hold."""

from __future__ import annotations

import json

import pytest

from experiments.crossover import analyze
from experiments.what_if import MIB, main, page_bytes, what_if
from test_crossover import CAP_WITH, CAP_WITHOUT, TRUE, analytic_crossover_pages, make_runs, make_steps, write_study

PB = 3 * MIB  # one page of every layer
ARENA = 512 * MIB


def study(ring="8"):
    runs = make_runs().assign(arena_bytes=ARENA, draft_mib=(CAP_WITHOUT - CAP_WITH) * PB / MIB,
                              config=json.dumps({"cache": {"ring_pages": ring}}))
    steps = make_steps()
    return runs, steps.assign(h2d_bytes=steps["streamed_pages"] * PB)


def test_page_bytes_from_the_streaming_steps():
    assert page_bytes(study()[1]) == PB


def test_own_arena_repeats_the_study_prediction_and_more_bytes_move_it_as_the_closed_form():
    runs, steps = study()
    same = what_if(runs, steps, ARENA / MIB)
    assert same["predicted"]["context_tokens"] == pytest.approx(analyze(runs, steps)["predicted"]["context_tokens"])
    # 15 MiB more hold 5 more pages per layer, with the draft and without it; no eject in these
    # steps, so the decode-length prediction is the steady one for the middle of the study's
    # 64-token decodes (step times linear in pages there; bisection: float rounding only)
    more = what_if(runs, steps, ARENA / MIB + 15)
    assert more["capacity_with_draft"][4 * 256] == CAP_WITH + 5
    assert set(runs["new_tokens"]) == {64}
    expect = analytic_crossover_pages(TRUE, CAP_WITH + 5, CAP_WITHOUT + 5) - 64 / 2 / 256
    assert more["predicted"]["pages_per_layer"] == pytest.approx(expect, rel=1e-9)
    assert more["predicted"]["pages_per_layer"] > same["predicted"]["pages_per_layer"]


def test_auto_ring_and_too_small_arenas_are_refused():
    runs, steps = study(ring="auto")
    with pytest.raises(ValueError, match=r"ring_pages was \['auto'\].*automatic ring re-sizes"):
        what_if(runs, steps, 500)
    runs, steps = study()
    with pytest.raises(ValueError, match=r"an arena of 480 MiB holds -0.7 pages per layer.*too small"):
        what_if(runs, steps, 480)  # 32 MiB less: 10.7 pages fewer than the study's 10


def test_cli_prints_each_arena(tmp_path, capsys):
    runs, steps = study()
    main([str(write_study(tmp_path, runs, steps)), "--arena-mib", "512", "527"])
    out = capsys.readouterr().out
    assert "arena 512 MiB measured" in out and "arena 527 MiB: pages per layer beside the draft" in out
    assert out.count("predicted crossover") == 4
