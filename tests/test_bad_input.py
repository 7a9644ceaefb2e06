"""The catalogue of known user errors, each through its real entry point in a subprocess: one line
``PROG: error: ...`` on stderr, exit code 2, no traceback, nothing written (the working folder and
the study folder stay as they were). Ctrl-C during a sweep: one line saying how many cells are
done and how to resume."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from test_draft import DRAFT_SPEC
from test_paged_cache import SPEC
from tiny_gguf import write_tiny_model

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
ENV.pop("HYDRA_FULL_ERROR", None)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("bad")
    (d / "corrupt.gguf").write_bytes(b"GGUF" + bytes(range(256)) * 4)
    return {"tiny": write_tiny_model(d / "t.gguf", SPEC), "draft": write_tiny_model(d / "d.gguf", DRAFT_SPEC),
            "corrupt": d / "corrupt.gguf"}


def run(module: str, args: list[str], cwd: Path, timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, env=ENV, capture_output=True, text=True,
                          timeout=timeout)


def assert_one_line(p: subprocess.CompletedProcess, prog: str, says: str, cwd: Path) -> None:
    out = p.stdout + p.stderr
    assert "Traceback" not in out and "HYDRA_FULL_ERROR" not in out, out[-3000:]
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1, (p.returncode, out[-3000:])
    assert lines[0].startswith(f"{prog}: error: ") and says in lines[0], lines[0]
    assert list(cwd.iterdir()) == [], f"written: {list(cwd.iterdir())}"


GENERATE = [  # (overrides, what the line says); {tiny} / {corrupt}: the module's files
    (["model.source=/nowhere/m.gguf"], "neither a registered name"),
    (["model.source={corrupt}"], "not a readable GGUF file"),
    (["cache=resident", "cache.type_k=q5_1"], "cache.type_k='q5_1'; choose one of"),
    (["cache=resident", "arena.mib=0.01"], "MiB"),  # ArenaTooSmall: after loading, still one line
    (["cache=resident", "arena.mib=0"], "arena.mib=0: give a positive size in MiB, or auto"),
    (["cache=resident", "arena.mib=-5"], "arena.mib=-5: give a positive size in MiB, or auto"),
    (["max_new_tokens=-1"], "max_new_tokens=-1: give a number of tokens >= 1"),
    (["prompt="], "prompt='': give a prompt"),
    (["model.weights=q8_0_int8"], "model.weights=q8_0_int8 multiplies decode rows in int8 in model.gemv's kernel"),
    (["spec=draft", "spec.draft.weights=q8_0_int8"],
     "spec.draft.weights=q8_0_int8 multiplies the draft's decode rows in int8 in model.gemv's kernel"),
    (["spec=draft", "spec.draft.weights=q4"], "spec.draft.weights='q4'; choose one of"),
    (["spec.type=ngram-simple", "spec.n_max=100"], "spec.n_max=100"),
    (["+foo=1"], "unknown key 'foo'"),
    (["cache=nope"], "Could not find 'cache/nope'; Available options in 'cache': contiguous, resident, stream"),
    (["max_new_tokens=[1"], "max_new_tokens=[1: no viable alternative"),
    (["cache=stream", "arena.mib=64", "model.max_context=4000000000", "max_new_tokens=3000000000"],
     "the host store needs 1190186 MiB (2 layers x 11718751 pages x 52 KiB of K+V) but the host has"),
    (["spec=mtp"], "spec.mtp.source is not set"),
    (["spec=mtp", "spec.mtp.source=/nowhere/h.gguf"], "spec.mtp.source=/nowhere/h.gguf: no such file"),
    (["spec=mtp", "spec.mtp.source={tiny}"], "not an MTP head"),
]


@pytest.mark.parametrize("overrides, says", GENERATE, ids=[" ".join(o) for o, _ in GENERATE])
def test_generate(models, tmp_path, overrides, says):
    args = [f"model.source={models['tiny']}", *(o.format(**models) for o in overrides)]
    assert_one_line(run("kvstream.cli.generate", args, tmp_path), "kvstream-generate", says, tmp_path)


PPL = [
    (["model.source=/nowhere/m.gguf"], "neither a registered name"),
    (["model.source={corrupt}"], "not a readable GGUF file"),
    (["ctx=2"], "ctx must be >= 3"),
    (["save_logits=a.lp", "compare_logits=b.lp"], "exclusive"),
    (["+foo=1"], "unknown key 'foo'"),
]


@pytest.mark.parametrize("overrides, says", PPL, ids=[" ".join(o) for o, _ in PPL])
def test_ppl(models, tmp_path, overrides, says):
    args = [f"model.source={models['tiny']}", "progress=false", *(o.format(**models) for o in overrides)]
    assert_one_line(run("kvstream.cli.ppl", args, tmp_path), "kvstream-ppl", says, tmp_path)


def test_ppl_save_logits_states_the_size_and_refuses_before_loading(qwen05_path, tmp_path):
    """The real 0.5B's vocabulary (151936): every chunk of the built-in text is far above 2 GiB."""
    p = run("kvstream.cli.ppl", [f"model.source={qwen05_path}", "save_logits=base.lp"], tmp_path)
    assert_one_line(p, "kvstream-ppl", "scored positions x 151936 vocab x 2 bytes, uint16), above the 2 GiB limit",
                    tmp_path)


def study_args(models, results: Path, *overrides: str) -> list[str]:
    return ["--multirun", f"model.source={models['tiny']}", f"spec.draft.source={models['draft']}", "hardware=cpu",
            f"results={results}", "study=t", "max_new_tokens=4", "progress=false", *overrides]


STUDY = [
    (["spec.n_max=100"], "spec.n_max=100"),
    (["+foo=1"], "unknown key 'foo'"),
    (["arm=nope"], "Could not find 'arm/nope'"),
    (["context=[1"], "context=[1: no viable alternative"),
]


@pytest.mark.parametrize("overrides, says", STUDY, ids=[" ".join(o) for o, _ in STUDY])
def test_study(models, tmp_path, overrides, says):
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    p = run("experiments.draft_threshold", study_args(models, tmp_path / "res", "arm=none,keep", *overrides), cwd)
    assert_one_line(p, "draft_threshold", says, cwd)
    assert not (tmp_path / "res").exists()


def test_study_refuses_a_folder_of_other_columns(models, tmp_path):
    (tmp_path / "res" / "t").mkdir(parents=True)
    (tmp_path / "res" / "t" / "runs.csv").write_text("run_id,tok_per_s\nx,1.0\n")
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    p = run("experiments.draft_threshold", study_args(models, tmp_path / "res", "arm=none,keep"), cwd)
    assert_one_line(p, "draft_threshold", "start a new study folder", cwd)
    assert [f.name for f in (tmp_path / "res" / "t").iterdir()] == ["runs.csv"]


@pytest.mark.parametrize("overrides, says", [(["steps=0"], "steps=0: must be >= 1"),
                                             (["model.source=/nowhere/m.gguf"], "neither a registered name")])
def test_train_mtp(models, tmp_path, overrides, says):
    args = [f"model.source={models['tiny']}", "hardware=cpu", f"out={tmp_path}/h.gguf", *overrides]
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    assert_one_line(run("experiments.train_mtp", args, cwd), "train_mtp", says, cwd)


def test_debug_shows_the_traceback(models, tmp_path):
    p = run("kvstream.cli.generate", [f"model.source={models['tiny']}", "max_new_tokens=-1", "--debug"], tmp_path)
    assert p.returncode != 0 and "Traceback" in p.stderr and "max_new_tokens=-1" in p.stderr


def test_ctrl_c_ends_a_sweep_with_one_line(models, tmp_path):
    """SIGINT once a cell is done: one line with the cells done and the resume command, exit 130."""
    cmd = [sys.executable, "-m", "experiments.draft_threshold",
           *study_args(models, tmp_path, "arm=none,keep", "rep=0,1,2,3,4,5", "context=300")]
    # SIGINT's default action in the sweep whatever this process inherited: a shell starts background
    # jobs with SIGINT ignored, and Python then installs no KeyboardInterrupt for it
    p = subprocess.Popen(cmd, cwd=tmp_path, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    for line in p.stdout:
        if re.match(r"\[t\] arm=\w+ context=300: ", line):  # a cell's row is written
            break
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 130 and "Traceback" not in out + err, err[-3000:]
    assert re.fullmatch(rf"draft_threshold: interrupted: \d+ cells done in {tmp_path}/t \(\d+ run now\); the same "
                        r"command resumes with the next\n", err), err
