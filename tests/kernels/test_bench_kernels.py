"""experiments/bench_kernels.py --quick runs end to end (CPU: interpreter) and writes its files."""
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import torch

ROOT = Path(__file__).resolve().parents[2]


def test_bench_kernels_quick(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, str(ROOT / "experiments" / "bench_kernels.py"), "--quick",
                        "--out", str(tmp_path)], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    for name in ("decode_attention.csv", "gather.csv", "store.csv", "ceilings.csv",
                 "bench_kernels.png", "command.txt"):
        assert (tmp_path / name).stat().st_size > 0, name
    # per compiled kernel (registers, load widths): kernels are compiled on CUDA only, none interpreted
    asm = (tmp_path / "asm.csv").read_text().strip()
    assert (len(asm.splitlines()) > 1) if torch.cuda.is_available() else asm == ""
    dec = pd.read_csv(tmp_path / "decode_attention.csv")
    assert len(dec) == 4 * 2 and (dec.us_graph > 0).all()  # every type pair, n_q 1 and 2
    # the programmatic-dependent timing: where launches can be dependents (sm_90+), else not taken
    pdl = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9
    assert (dec.us_graph_pdl > 0).all() if pdl else dec.us_graph_pdl.isna().all()
    assert "--quick" in (tmp_path / "command.txt").read_text()
    # --compare: two runs' folders side by side (here the run with itself: every ratio 1)
    r = subprocess.run([sys.executable, str(ROOT / "experiments" / "bench_kernels.py"), "--compare", str(tmp_path),
                        str(tmp_path)], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.strip().splitlines()
    assert "ratio" in lines[0] and len(lines) == 1 + 8 and all(" 1.0 " in line for line in lines[1:]), r.stdout
