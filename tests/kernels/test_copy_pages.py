"""Row copy by index lists (kernels/copy_pages.py): kernel vs reference, byte for byte (no
tolerance: it moves bytes), for widths of 16 bytes up to real pages, index patterns, two jobs
in one launch, program counts; every launcher error."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton

from kernels import copy_pages as cp
from kernels.formats import PageFormat

from tests.kernels.conftest import DEVICE

K_PAGE = PageFormat("q8_0", 2, 128).page_bytes  # 69632: 17 whole 4 KB blocks
V_PAGE = PageFormat("q4_0", 2, 128).page_bytes  # 36864: 9 whole blocks
ODD_PAGE = PageFormat("q8_0", 2, 64).page_bytes  # 34816: 8.5 blocks (a masked last block)
WIDTHS = [16, 48, ODD_PAGE, K_PAGE, V_PAGE]  # 48: 12 words in a 16-word block
SRC_KINDS = ["device"] + (["pinned"] if torch.cuda.is_available() else [])  # zero-copy reads need CUDA


def _bytes(n, width, gen, src_kind="device"):
    t = torch.randint(0, 256, (n, width), dtype=torch.uint8, generator=gen)
    return t.pin_memory() if src_kind == "pinned" else t.to(DEVICE)


def _idx(values, dtype=torch.int32):
    return torch.tensor(values, dtype=dtype, device=DEVICE)


def _expect(src, dst, src_rows, dst_rows):
    want = dst.cpu().clone()
    cp.reference(src.cpu(), want, src_rows.cpu(), dst_rows.cpu())
    return want


def test_page_widths_are_multiples_of_16():
    assert all(w % 16 == 0 for w in WIDTHS)


PATTERNS = {  # name: (source rows, destination rows) into 9 source and 7 destination rows
    "identity": ([0, 1, 2, 3], [0, 1, 2, 3]),
    "permuted": ([5, 2, 8, 0, 7, 1, 4], [3, 6, 0, 5, 1, 4, 2]),
    "repeated_source": ([3, 3, 3, 0], [6, 0, 2, 5]),
    "sparse": ([8, 0], [0, 6]),
    "one": ([4], [2]),
    "empty": ([], []),
}


# identity / one row only at small widths: the page widths add nothing there but interpreter time
CASES = [(w, p) for w in WIDTHS for p in PATTERNS if w <= 48 or p not in ("identity", "one")]


@pytest.mark.parametrize("width,pattern", CASES)
@pytest.mark.parametrize("src_kind", SRC_KINDS)
def test_copy_rows_matches_reference(width, pattern, src_kind, gen):
    src_rows, dst_rows = PATTERNS[pattern]
    src, dst = _bytes(9, width, gen, src_kind), _bytes(7, width, gen)
    s, d = _idx(src_rows), _idx(dst_rows, torch.int64)  # both index dtypes
    want = _expect(src, dst, s, d)
    cp.copy_rows(src, dst, s, d, programs=3)
    assert torch.equal(dst.cpu(), want)  # exact: bytes; rows not listed keep their bytes


@pytest.mark.parametrize("programs", [1, 2, 5, None, 1000])  # 1000: more than there are tiles
def test_program_counts(programs, gen):
    src, dst = _bytes(12, V_PAGE, gen), _bytes(12, V_PAGE, gen)
    perm = torch.randperm(12, generator=gen)
    s, d = _idx(perm[:10].tolist()), _idx(torch.randperm(12, generator=gen)[:10].tolist())
    want = _expect(src, dst, s, d)
    cp.copy_rows(src, dst, s, d, programs=programs)
    assert torch.equal(dst.cpu(), want)


@pytest.mark.parametrize("n_k,n_v", [(3, 4), (0, 2), (2, 0), (0, 0), (1, 1)])
def test_two_jobs_in_one_launch(n_k, n_v, gen):
    """A layer's K and V pages (different widths) in one launch; either list may be empty."""
    ks, kd, vs, vd = _bytes(6, K_PAGE, gen), _bytes(5, K_PAGE, gen), _bytes(6, V_PAGE, gen), _bytes(5, V_PAGE, gen)
    pick = lambda n, k, dtype=torch.int32: _idx(torch.randperm(n, generator=gen)[:k].tolist(), dtype)  # noqa: E731
    k_rows, v_rows = (pick(6, n_k), pick(5, n_k)), (pick(6, n_v, torch.int64), pick(5, n_v))
    want_k, want_v = _expect(ks, kd, *k_rows), _expect(vs, vd, *v_rows)
    cp.copy_jobs([(ks, kd, *k_rows), (vs, vd, *v_rows)], programs=4)
    assert torch.equal(kd.cpu(), want_k) and torch.equal(vd.cpu(), want_v)


def test_tiny_rows_beside_pages_in_one_launch(gen):
    """Jobs of 16-byte and 48-byte rows: one block size serves both, each masked to its width."""
    a_src, a_dst, b_src, b_dst = _bytes(5, 16, gen), _bytes(5, 16, gen), _bytes(5, 48, gen), _bytes(4, 48, gen)
    a_rows, b_rows = (_idx([4, 0, 2]), _idx([1, 3, 0])), (_idx([1, 1, 3, 4]), _idx([3, 0, 2, 1]))
    want_a, want_b = _expect(a_src, a_dst, *a_rows), _expect(b_src, b_dst, *b_rows)
    cp.copy_jobs([(a_src, a_dst, *a_rows), (b_src, b_dst, *b_rows)], programs=2)
    assert torch.equal(a_dst.cpu(), want_a) and torch.equal(b_dst.cpu(), want_b)


def test_views_offset_into_buffers_leave_their_neighbours_alone(gen):
    """src and dst are 16-byte aligned views inside larger buffers: the bytes around dst keep
    their values (masked tails write nothing past a row)."""
    buf = _bytes(1, 32 + 3 * ODD_PAGE + 32, gen).view(-1)
    before = buf.cpu().clone()
    dst = buf[32:32 + 3 * ODD_PAGE].view(3, ODD_PAGE)
    src = _bytes(1, 16 + 4 * ODD_PAGE, gen).view(-1)[16:].view(4, ODD_PAGE)
    s, d = _idx([3, 1]), _idx([2, 0])
    cp.copy_rows(src, dst, s, d)
    want = before.clone()
    want[32:32 + 3 * ODD_PAGE].view(3, ODD_PAGE)[[2, 0]] = src.cpu()[[3, 1]]
    assert torch.equal(buf.cpu(), want)


@pytest.mark.bigmem
def test_rows_past_2gib(big_storage, gen):
    """Source rows at and past 2^31 bytes (the one straddling it included) land where they should."""
    n = big_storage.numel() // K_PAGE
    src = big_storage[:n * K_PAGE].view(n, K_PAGE)
    first = -(-(2**31) // K_PAGE)
    rows = [first - 1, first, n - 1]
    src[rows] = _bytes(3, K_PAGE, gen)
    dst = _bytes(3, K_PAGE, gen)
    cp.copy_rows(src, dst, _idx(rows, torch.int64), _idx([2, 0, 1]))
    assert torch.equal(dst.cpu()[[2, 0, 1]], src[rows].cpu())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need CUDA")
def test_graph_replay_reads_the_index_tensors_anew(gen):
    """Captured once, replayed with new index values: the grid depends on shapes only."""
    src, dst = _bytes(8, K_PAGE, gen, "pinned"), _bytes(4, K_PAGE, gen)
    s, d = _idx([0, 1, 2]), _idx([0, 1, 2])
    cp.copy_rows(src, dst, s, d)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        cp.copy_rows(src, dst, s, d)
    s.copy_(_idx([7, 5, 3]))
    d.copy_(_idx([3, 0, 1]))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(dst.cpu()[[3, 0, 1]], src[[7, 5, 3]])


SM90_PTX = """
import collections, re, sys, torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kernels import copy_pages as cp
(kw, kb, ki, _), (vw, vb, vi, _) = (cp._tiling((None, torch.empty(1, w), torch.empty(1))) for w in map(int, sys.argv[1:3]))
const = dict(A_ROW_WORDS=kw, A_BLOCK=kb, A_ITEMS=ki, B_ROW_WORDS=vw, B_BLOCK=vb, B_ITEMS=vi, TWO=True)
kern = cp._copy_kernel
sig, consts, attrs = {}, {}, {}
for i, p in enumerate(kern.params):
    if p.is_constexpr:
        sig[p.name], consts[(i,)] = "constexpr", const[p.name]
    elif p.name.endswith("_n"):
        sig[p.name] = "i32"
    else:  # pointers, 16-byte aligned as the launcher demands (what a launch specializes on)
        sig[p.name] = "*i32" if p.name.endswith("rows") else "*u8"
        attrs[(i,)] = [["tt.divisibility", 16]]
c = triton.compile(ASTSource(fn=kern, signature=sig, constexprs=consts, attrs=attrs),
                   target=GPUTarget("cuda", 90, 32), options=dict(num_warps=cp.NUM_WARPS))
print(dict(collections.Counter(re.findall(r"\\b((?:ld|st)\\.(?:volatile\\.)?global[\\w.]*)", c.asm["ptx"]))))
"""


@pytest.mark.skipif(not (Path(triton.backends.nvidia.__file__).parent / "bin" / "ptxas").exists(),
                    reason="Triton's NVIDIA tools are not bundled here")
def test_sm90_build_moves_16_bytes_per_access():
    """Compiled for sm_90 (no GPU needed) as a K + V launch: every page load is a volatile
    16-byte vector, every store a 16-byte vector (one loop per job, 8 each per thread)."""
    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # a real compile
    env["PYTHONPATH"] = str(root) + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, "-c", SM90_PTX, str(K_PAGE), str(V_PAGE)],
                       capture_output=True, text=True, env=env, cwd=root, timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]
    ops = eval(r.stdout.strip().splitlines()[-1])
    assert ops.get("ld.volatile.global.v4.b32") == 16 and ops.get("st.global.v4.b32") == 16, ops
    assert not {op for op in ops if op.startswith(("ld.volatile", "st.global")) and ".v4." not in op}, ops


# -- launcher errors -----------------------------------------------------------------------------

def _job(width=32, n_src=4, n_dst=4, n=2):
    return [torch.zeros(n_src, width, dtype=torch.uint8, device=DEVICE),
            torch.zeros(n_dst, width, dtype=torch.uint8, device=DEVICE), _idx(list(range(n))), _idx(list(range(n)))]


def _with(i, value, **kw):
    job = _job(**kw)
    job[i] = value
    return job


def _meta(*shape, dtype=torch.uint8):
    return torch.empty(*shape, dtype=dtype, device="meta")


BAD_JOBS = {  # name: (job, message fragment)
    "src_dtype": (_with(0, torch.zeros(4, 8, dtype=torch.int32, device=DEVICE)),
                  r"src must be a 2-D uint8 tensor .*int32"),
    "dst_1d": (_with(1, torch.zeros(64, dtype=torch.uint8, device=DEVICE)), r"dst must be a 2-D uint8 tensor .*\(64,\)"),
    "not_tensor": (_with(0, [[0] * 32]), r"src must be a torch.Tensor, got list"),
    "widths": (_with(1, torch.zeros(4, 48, dtype=torch.uint8, device=DEVICE)), r"one width, got 32 and 48 bytes"),
    "width_not_16": (_job(width=24), r"multiple of 16 bytes .*got 24"),
    "width_0": (_job(width=0), r"multiple of 16 bytes .*got 0"),
    "rows_strided": (_with(0, torch.zeros(4, 64, dtype=torch.uint8, device=DEVICE)[:, :32]),
                     r"src rows must be contiguous: stride \(32, 1\) expected, got \(64, 1\)"),
    "bytes_strided": (_with(1, torch.zeros(32, 1, dtype=torch.uint8, device=DEVICE).expand(32, 32)[:1]),
                      r"dst bytes must be contiguous \(stride 1\)"),
    "misaligned": (_with(0, torch.zeros(4 * 32 + 8, dtype=torch.uint8, device=DEVICE)[8:].view(4, 32)),
                   r"src must start 16-byte aligned, data_ptr % 16 = 8"),
    "index_dtype": (_with(2, torch.zeros(2, dtype=torch.float32, device=DEVICE)),
                    r"src_rows must be a contiguous 1-D int32 / int64 tensor, got torch.float32"),
    "index_2d": (_with(3, torch.zeros(1, 2, dtype=torch.int32, device=DEVICE)), r"dst_rows must be .* 1-D .*\(1, 2\)"),
    "index_strided": (_with(2, torch.zeros(4, dtype=torch.int32, device=DEVICE)[::2]),
                      r"src_rows must be a contiguous .*stride \(2,\)"),
    "index_device": (_with(3, _meta(2, dtype=torch.int32)), r"dst_rows must be on dst's device .*got meta"),
    "index_lengths": (_with(3, _idx([0, 1, 2])), r"one length, got 2 and 3"),
    "src_device": (_with(0, _meta(4, 32)), r"src must be on dst's device .*got meta"),
}


@pytest.mark.parametrize("case", BAD_JOBS)
def test_launcher_rejects(case):
    job, message = BAD_JOBS[case]
    with pytest.raises(ValueError, match=message):
        cp.copy_jobs([job])


@pytest.mark.parametrize("jobs,message", [
    ([], r"jobs must be a list of 1 or 2 .*got 0"),
    ([_job()] * 3, r"jobs must be a list of 1 or 2 .*got 3"),
    ("abc", r"jobs must be a list .*got str"),
    ([_job()[:3]], r"job 0: must be a \(src, dst, src_rows, dst_rows\) tuple, got list of 3"),
    ([_job(), [_meta(4, 32), _meta(4, 32), _meta(2, dtype=torch.int32), _meta(2, dtype=torch.int32)]],
     r"both jobs' dst must be on one device"),
])
def test_launcher_rejects_job_lists(jobs, message):
    with pytest.raises(ValueError, match=message):
        cp.copy_jobs(jobs)


@pytest.mark.parametrize("programs", [0, -1, 2.5, True])
def test_launcher_rejects_program_counts(programs):
    with pytest.raises(ValueError, match=r"programs must be None or an int >= 1"):
        cp.copy_rows(*_job(), programs=programs)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned memory needs CUDA")
def test_launcher_rejects_pageable_host_source():
    job = _job()
    job[0] = job[0].cpu()
    with pytest.raises(ValueError, match=r"src on the host must be pinned"):
        cp.copy_rows(*job)
