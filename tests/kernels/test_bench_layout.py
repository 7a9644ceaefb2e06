"""experiments/bench_layout.py: the GGML-row gather kernel equals kernels.gather.gather bit for
bit (on CPU under the interpreter, on CUDA when there is a GPU), and --quick runs end to end.

Tolerance: exact (compared as int16 bit patterns). Both kernels dequantize the same bytes with
the same code (kernels.gather._dequant): int8 or nibble - 8 times the fp16 scale is exact in
fp32 (at most 8 x 11 significant bits), then rounded once to fp16, so only where the bytes are
read from differs, and any misplaced byte shows up as a different value.
"""
import itertools
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch

from experiments.bench_layout import GGML_LAUNCHES, gather_ggml
from kernels import reference
from kernels.formats import PAGE_TOKENS, PageFormat, page_to_ggml
from kernels.gather import gather

ROOT = Path(__file__).resolve().parents[2]
N_TOKENS = (1, 255, 257, 600)


def _pages(fmt: PageFormat, n_pages: int, gen: torch.Generator) -> torch.Tensor:
    """Random split pages: every quant byte value, scales of both signs and many magnitudes
    (fp16 subnormals included), all finite."""
    pool = torch.randint(0, 256, (n_pages, fmt.page_bytes), dtype=torch.uint8, generator=gen)
    s = pool[:, fmt.scale_offset:].view(torch.float16)
    s.copy_(torch.randn(s.shape, generator=gen) * torch.exp2(torch.randint(-20, 4, s.shape, generator=gen)))
    return pool


def _check(t, head_dim, n_kv_heads, n_tokens, launches, device):
    fmt = PageFormat(t, n_kv_heads, head_dim)
    gen = torch.Generator().manual_seed(n_tokens * 7 + head_dim + n_kv_heads)
    n_pages = -(-n_tokens // PAGE_TOKENS)
    split = _pages(fmt, 2 * n_pages + 1, gen)
    ggml = page_to_ggml(split, fmt)  # [n, 256, row_bytes], what the GGML-row kernel reads
    ids = torch.randperm(split.shape[0], generator=gen)[:n_pages].int()  # sparse, permuted
    want = gather(split.to(device), ids.to(device), n_tokens, fmt).cpu().view(torch.int16)
    assert torch.equal(want, reference.gather(split, ids, n_tokens, fmt).view(torch.int16))
    for launch in launches:
        got = gather_ggml(ggml.to(device), ids.to(device), n_tokens, fmt, launch=launch)
        assert got.shape == (n_tokens, n_kv_heads, head_dim) and got.dtype == torch.float16
        assert torch.equal(got.cpu().view(torch.int16), want), launch


# every (type, head_dim, n_kv_heads) with two of N_TOKENS, each n_tokens with both of every
# axis (the interpreter runs ~10 ms per program: the full product took ~35 s on 2 cores)
COMBOS = list(itertools.product(("q8_0", "q4_0"), (64, 128), (1, 2)))
CASES = [(*c, N_TOKENS[(i + i // 4 + k) % 4]) for i, c in enumerate(COMBOS) for k in (0, 2)]


@pytest.mark.parametrize("t,head_dim,n_kv_heads,n_tokens", CASES)
def test_ggml_rows_equal_split_gather(t, head_dim, n_kv_heads, n_tokens, device):
    _check(t, head_dim, n_kv_heads, n_tokens, GGML_LAUNCHES[:1], device)  # gather's launch


@pytest.mark.parametrize("t,head_dim", [("q8_0", 64), ("q4_0", 128)])
def test_ggml_rows_every_launch(t, head_dim, device):
    _check(t, head_dim, 2, 257, GGML_LAUNCHES[1:], device)  # a page and one token: both masks


def test_ggml_rows_rejects_f16(device):
    fmt = PageFormat("f16", 1, 64)
    with pytest.raises(ValueError, match="q8_0 / q4_0 only"):
        gather_ggml(torch.zeros(1, fmt.page_bytes, dtype=torch.uint8, device=device),
                    torch.zeros(1, dtype=torch.int32, device=device), 10, fmt)


def test_bench_layout_quick(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, str(ROOT / "experiments" / "bench_layout.py"), "--quick",
                        "--out", str(tmp_path)], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    df = pd.read_csv(tmp_path / "layout.csv")
    n = 2 + len(GGML_LAUNCHES)  # split first and last, every GGML-row launch
    assert len(df) == 2 * n and set(df.type) == {"q8_0", "q4_0"}
    for _, rows in df.groupby("type"):
        assert list(rows.layout) == ["split"] + ["ggml"] * (n - 2) + ["split"]
    assert df.equal.all() and (df.us_graph > 0).all() and (df.gbps > 0).all()
    assert (df.bytes == 40 * (272 + 512)).sum() == n and (df.bytes == 40 * (144 + 512)).sum() == n
    split = df[df.layout == "split"].groupby("type").us_graph.mean()
    assert ((df.ratio_split - df.us_graph / df.type.map(split)).abs() < 1e-9).all()
    for col in ("frac_copy", "copy_gbps", "split_drift", "ld_v4", "ld_b16", "commit", "dirty", "command"):
        assert col in df.columns, col
    assert "--quick" in df.command.iloc[0]
    # per compiled kernel: load widths from the PTX; kernels are compiled on CUDA only
    asm = (tmp_path / "asm.csv").read_text().strip()
    assert (len(asm.splitlines()) > 1) if torch.cuda.is_available() else len(asm.splitlines()) <= 1
