"""bench_peers and bench_step on CPU: the kvstream arms on a tiny model; a failing peer loses no
row; a step split into its host phases."""

from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd
import pytest

from experiments import bench_peers
from test_paged_cache import SPEC
from tiny_gguf import write_tiny_model


def test_rows_are_kept_when_a_peer_arm_crashes(tmp_path, monkeypatch):
    model = write_tiny_model(tmp_path / "tiny.gguf", SPEC)

    def crashing_peer(*args):  # what the llama.cpp arm raises when its child process segfaults
        raise RuntimeError("llama.cpp child failed (-11): ")

    monkeypatch.setitem(bench_peers.ARMS, "crashing-peer", crashing_peer)
    monkeypatch.setattr(sys, "argv", ["bench_peers", "--model", str(model), "--contexts", "300", "--new-tokens", "3",
                                      "--arms", "kvstream-resident", "crashing-peer", "kvstream-stream",
                                      "--out", str(tmp_path / "out")])
    bench_peers.main()
    df = pd.read_csv(tmp_path / "out" / "cpu_tiny.gguf.csv")
    assert list(df.arm) == ["kvstream-resident", "crashing-peer", "kvstream-stream"]
    assert df.decode_tok_s.iloc[[0, 2]].gt(0).all() and df.decode_tok_s.isna().iloc[1]
    assert "child failed (-11)" in df.error.iloc[1] and df.error.iloc[[0, 2]].isna().all()
    # kvstream resident's tok/s over each arm's: the stream arm's ratio from the two rows, the crashed one none
    assert df.kvstream_resident_over_arm.iloc[2] == pytest.approx(df.decode_tok_s.iloc[0] / df.decode_tok_s.iloc[2],
                                                                  rel=1e-12)  # float division
    assert df.kvstream_resident_over_arm.isna().iloc[1]
    assert (tmp_path / "out" / "cpu_tiny.gguf.png").exists()


def test_the_q8_arm_decodes_with_q8_0_int8_weights(tmp_path, monkeypatch):
    """``kvstream-q8``: model.weights=q8_0_int8 with model.gemv (on the CPU their reference path)."""
    from experiments.common import _BY_PATH

    model = write_tiny_model(tmp_path / "tiny.gguf", SPEC)
    monkeypatch.setattr(sys, "argv", ["bench_peers", "--model", str(model), "--contexts", "300", "--new-tokens", "3",
                                      "--arms", "kvstream-resident", "kvstream-q8", "--out", str(tmp_path / "out")])
    bench_peers.main()
    df = pd.read_csv(tmp_path / "out" / "cpu_tiny.gguf.csv")
    assert list(df.arm) == ["kvstream-resident", "kvstream-q8"] and df.decode_tok_s.gt(0).all()
    assert "error" not in df or df.error.isna().all()
    assert any(Path(k[0]) == model and k[1:] == ("q8_0_int8", True) for k in _BY_PATH)  # the arm's own load


def test_bench_step_splits_a_step_into_host_phases(tmp_path, capsys):
    from experiments import bench_step

    model = write_tiny_model(tmp_path / "tiny.gguf", SPEC)
    bench_step.main(["--model", str(model), "--context", "300", "--steps", "4", "--out", str(tmp_path / "out")])
    df = pd.read_csv(tmp_path / "out" / "step_cpu_tiny.gguf_300.csv")
    assert len(df) == 4 and (df[["sample", "token", "call", "begin", "commit"]] > 0).all().all()
    assert (df["begin"] + df["commit"] < df["call"]).all()  # both happen inside the model call
    assert df["gpu"].isna().all() and df["gpu_greedy"].isna().all()  # no captured step on CPU
    assert "host phases" in capsys.readouterr().out
    # --report: the medians (the first step left out) and, for a CUDA file, its kernels CSV's totals
    cuda = tmp_path / "out" / "step_cuda_tiny.gguf_300.csv"
    df.to_csv(cuda, index=False)
    pd.DataFrame({"kernel": ["a", "b"], "us_per_step": [10.0, 2.5], "calls_per_step": [28.0, 1.0]}).to_csv(
        tmp_path / "out" / "kernels_tiny.gguf_300.csv", index=False)
    table = bench_step.report([str(tmp_path / "out" / "step_cpu_tiny.gguf_300.csv"), str(cuda)])
    assert table["generate_ms"].tolist() == [1e3 * df["generate_s"].iloc[1:].median()] * 2
    assert table["kernel_us"].isna().iloc[0] and table["kernel_us"].iloc[1] == 12.5 and table["launches"].iloc[1] == 29
    bench_step.main(["--report", str(cuda)])
    assert "generate_ms" in capsys.readouterr().out


def test_bench_step_compares_gemv_runs_with_plain_ones_per_code_folder():
    """The committed model.gemv runs (results/step/gemv): means per (model, context, code folder)
    against every plain run of that model and context."""
    from pathlib import Path

    from experiments import bench_step

    files = sorted(str(p) for p in Path(__file__).parents[1].glob("results/step/gemv/*/*/step_*.csv"))
    t = bench_step.compare(bench_step.report(files))
    row = t[(t.context == 4096) & t.model.str.startswith("qwen2.5-coder-1.5b") & (t.code == "04120d3")].iloc[0]
    plain = [r for r in bench_step.report(files).itertuples() if r.context == 4096 and not r.gemv
             and r.model.startswith("qwen2.5-coder-1.5b")]
    assert row.runs == 4 and len(plain) == 4
    assert row.plain_gpu_ms == pytest.approx(sum(r.gpu_ms for r in plain) / 4)
    assert row.gpu_ratio == pytest.approx(row.gpu_ms / row.plain_gpu_ms) and row.gpu_ratio < 1
    assert set(t.code) == {"04120d3", "1bdbdfe"}  # runs of other code stay apart


def test_bench_gemv_report_reads_the_committed_run(capsys):
    from pathlib import Path

    from experiments import bench_gemv

    bench_gemv.main(["--report", str(Path(__file__).parents[1] / "results/kernels/gemv")])
    out = capsys.readouterr().out
    assert "gemv_pdl" in out and "fastest gemv_pdl launch per matrix in the sweep (n = 1)" in out


def test_bench_gemv_tables_with_the_tensor_core_arms():
    """A run's tables with the tensor-core kernel: its arm per matrix, its sweep at 5 rows beside the
    CUDA-core one's, chains at rows the CUDA-core kernel does not take (no gemv arms there)."""
    from experiments import bench_gemv

    mats = [("qkv", 2048, 1536), ("down", 1536, 8960)]
    df = pd.DataFrame([dict(model="m", matrix=m, N=N, K=K, n=n, launch="(16, 256, 4, 4)", **{
        f"{a}_{c}": 1.0 + i for i, a in enumerate(bench_gemv.arms_for(bench_gemv.MATRIX_ARMS, n))
        for c in ("us", "frac_read", "rel_err")}) for m, N, K in mats for n in (1, 5, 16)])
    chains = pd.DataFrame([dict(model="m", n=n, arm=a, chain_us=100.0 - i, weight_bytes=4e8, read_gbps=4e3,
                                pdl_bit_identical=True, rel_diff_vs_cublas=0.01)
                           for n in (1, 16) for i, a in enumerate(bench_gemv.arms_for(bench_gemv.ARMS, n))])
    sweep = pd.DataFrame([dict(model="m", matrix=m, n=n, arm=a, launch=str(bn), **{f"{a}_us": 2.0 + bn,
                                                                                   f"{a}_frac_read": 0.5})
                          for m, _, _ in mats for a, n in (("gemv_pdl", 1), ("mma_pdl", 5)) for bn in (16, 32)])
    out = bench_gemv.tables(df, chains, sweep)
    assert "mma_pdl_us" in out and "fastest mma_pdl launch per matrix in the sweep (n = 5)" in out
    # (the q8_0 chains as the model routes them: q8_linear at 16 rows, with and without PDL's norms)
    assert set(chains[chains.n == 16].arm) == {"cublas", "mma_pdl_glu", "gemv_pdl_model", "q8_linear_model",
                                              "q8_pdl_model", "q8i_pdl_model"}
    assert not {"q8_pdl", "q8i_pdl", "q8x_pdl"} & set(bench_gemv.arms_for(bench_gemv.MATRIX_ARMS + bench_gemv.GLU_ARMS, 16))


def test_bench_stream_figure_redraws_from_its_csv(tmp_path, monkeypatch):
    """``bench_stream --plot CSV`` draws the committed run's figure without a GPU."""
    from pathlib import Path

    from experiments import bench_stream

    csv = tmp_path / "stream_decode.csv"
    df = pd.read_csv(Path(__file__).parents[1] / "results/stream/stream_decode.csv")
    df.to_csv(csv, index=False)
    monkeypatch.setattr(sys, "argv", ["bench_stream", "--plot", str(csv)])
    bench_stream.main()
    png = csv.with_suffix(".png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
