"""kernels.stage against its plain-torch reference (reference.stage_rows): the same int64 entries,
exactly (integer arithmetic), at page boundaries, past the table's last page (clamped), with
a start read from one of the entries it writes."""
import pytest
import torch

from kernels import reference
from kernels.formats import PAGE_TOKENS
from kernels.stage import stage_rows

W, LAYERS, PAGES = 16, 5, 7


def buffers(device, gen):
    """One step buffer's views as the cache lays them out (positions | slots | length | lengths), filled
    with noise, and random page tables."""
    step = torch.randint(-9, 9, (W + LAYERS * W + 1 + W,), generator=gen).to(device)
    views = step[:W], step[W:W * (1 + LAYERS)].view(LAYERS, W), step[W * (1 + LAYERS) + 1:]
    tables = torch.randint(0, 1000, (LAYERS, PAGES), generator=gen, dtype=torch.int32).to(device)
    return step, views, tables


@pytest.mark.parametrize("start, offset, n", [(0, 0, 1), (250, 3, 8), (PAGE_TOKENS - 1, 0, 16), (700, 300, 5),
                                              (PAGES * PAGE_TOKENS - 2, 0, 4), (5000, 0, 3)])
def test_stage_rows_equals_the_reference(device, gen, start, offset, n):
    step, views, tables = buffers(device, gen)
    ref = step.clone()
    base = torch.tensor([start], device=device)
    stage_rows(*views, tables, base, offset, n)
    rviews = ref[:W], ref[W:W * (1 + LAYERS)].view(LAYERS, W), ref[W * (1 + LAYERS) + 1:]
    reference.stage_rows(*rviews, tables, base, offset, n)
    assert torch.equal(step, ref)  # integers: exact; entries past n and the prefill length untouched
    p = start + offset
    assert views[0][:n].tolist() == list(range(p, p + n)) and views[2][:n].tolist() == list(range(p + 1, p + n + 1))
    page = min(p // PAGE_TOKENS, PAGES - 1)
    assert int(views[1][3, 0]) == int(tables[3, page]) * PAGE_TOKENS + p % PAGE_TOKENS


def test_stage_rows_may_start_from_an_entry_it_writes(device, gen):
    """A greedy step stages its successor from its own length (lengths[0]): the start is read before it
    is overwritten."""
    step, (pos, slots, lens), tables = buffers(device, gen)
    lens[0] = 300
    stage_rows(pos, slots, lens, tables, lens[:1], 0, 1)
    assert int(pos[0]) == 300 and int(lens[0]) == 301
    assert int(slots[0, 0]) == int(tables[0, 1]) * PAGE_TOKENS + 300 - PAGE_TOKENS


def test_stage_rows_rejects_bad_input(device, gen):
    _, (pos, slots, lens), tables = buffers(device, gen)
    base = torch.zeros(1, dtype=torch.int64, device=device)
    with pytest.raises(ValueError, match="17 rows do not fit the step buffers' 16"):
        stage_rows(pos, slots, lens, tables, base, 0, W + 1)
    with pytest.raises(ValueError, match=r"tables \(4, 7\)"):
        stage_rows(pos, slots, lens, tables[:4], base, 0, 1)
    with pytest.raises(ValueError, match="int32 tables, got .*torch.int64"):
        stage_rows(pos, slots, lens, tables.long(), base, 0, 1)
