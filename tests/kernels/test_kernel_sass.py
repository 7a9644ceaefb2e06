"""experiments/kernel_sass.py compiles decode attention for sm_90 without a GPU and finds its loop."""
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import triton

from experiments import kernel_sass

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(triton.backends.nvidia.__file__).parent / "bin"


@pytest.mark.skipif(not (BIN / "nvdisasm").exists(), reason="Triton's NVIDIA tools are not bundled here")
def test_kernel_sass_reports_the_loop_of_an_sm90_build(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # a real compile, not the interpreter
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    csv = tmp_path / "loops.csv"
    r = subprocess.run([sys.executable, "-m", "experiments.kernel_sass", "--n-q", "1", "--out", str(tmp_path),
                        "--csv", str(csv)], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    # the key loop holds the tensor-core dots and the tile's shared-memory reads, whatever the version
    assert "q8_0/q4_0 n_q=1" in r.stdout and "HMMA" in r.stdout and "LDS" in r.stdout, r.stdout
    # two loops: the whole tiles', without the causal select's compare-and-select, and the masked last tiles'
    row = pd.read_csv(csv).iloc[0]
    assert row.pair == "q8_0/q4_0" and row.block_n == 64 and 0 < row.loop_instructions < row.edge_loop_instructions
    table = kernel_sass.compare([str(csv)])
    commit = row.commit[:7] + ("+" if row.dirty else "")
    assert table.loc[("q8_0/q4_0", 1), ("per_key", commit)] == round(row.loop_instructions * row.num_warps / 64, 1)
    # --launch: another launch's build (one warp), named in its row
    one = tmp_path / "one.csv"
    r = subprocess.run([sys.executable, "-m", "experiments.kernel_sass", "--n-q", "1", "--launch", "64", "1", "2",
                        "--csv", str(one)], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert pd.read_csv(one).iloc[0].num_warps == 1
    sass = (tmp_path / "decode_q8_0_q4_0_nq1.sass").read_text()
    assert "HMMA" in sass and (tmp_path / "decode_q8_0_q4_0_nq1.ttgir").stat().st_size > 0


@pytest.mark.skipif(not (BIN / "nvdisasm").exists(), reason="Triton's NVIDIA tools are not bundled here")
def test_kernel_sass_reports_q8_gemvs_loop():
    """``--q8-gemv``: the exact loop turns quants to fp32 by PRMT (no I2F); the int8 one takes dp4a (IDP) and
    rounds x (FRND); given x's blocks (``--xq``) it takes dp4a and rounds nothing."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    run = lambda *a: subprocess.run([sys.executable, "-m", "experiments.kernel_sass", "--q8-gemv", "16", "512", "4", *a],
                                    capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    exact, int8, xq, split = run(), run("--int8"), run("--xq"), run("--xq", "--split", "2")
    for r in (exact, int8, xq, split):
        assert r.returncode == 0, r.stderr[-3000:]
    assert "K split 2 ways" in split.stdout and "IDP" in split.stdout, split.stdout
    assert "PRMT" in exact.stdout and "I2F" not in exact.stdout and "a weight byte" in exact.stdout, exact.stdout
    assert "IDP" in int8.stdout and "FRND" in int8.stdout, int8.stdout
    assert "IDP" in xq.stdout and "FRND" not in xq.stdout and "x's blocks given" in xq.stdout, xq.stdout
