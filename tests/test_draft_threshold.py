"""The study workflow on tiny models: cells write rows and steps, a re-run skips finished cells,
the analysis writes its tables and figure; every config in conf/ composes into typed objects."""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import asdict
from pathlib import Path

import pandas as pd
import pytest
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

import conf
from experiments.common import review_prompt
from experiments.draft_threshold import StudyConfig, analyze, arm_of, run_cell
from experiments.publish import write_steps
from kvstream.cli.ppl import PplConfig
from kvstream.config import GenerateConfig, to_typed
from kvstream.model.tokenizer import Tokenizer
from test_draft import DRAFT_SPEC
from test_paged_cache import SPEC
from tiny_gguf import write_tiny_model

CONF = Path(conf.__file__).parent


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("study")
    return write_tiny_model(d / "t.gguf", SPEC), write_tiny_model(d / "d.gguf", DRAFT_SPEC)


def study_cfg(tiny, tmp_path, **over) -> StudyConfig:
    overrides = [f"model.source={tiny[0]}", f"spec.draft.source={tiny[1]}", "hardware=cpu", f"results={tmp_path}",
                 "study=t", "context=700", "max_new_tokens=24", "prefill_chunk=16", "spec.draft.chunk=16",
                 "progress=false", "arena.mib=1.42", "cache.ring_pages=4", "policy.stable_decodes=0",
                 *[f"{k}={v}" for k, v in over.items()]]
    with initialize_config_module("conf", version_base=None):
        return to_typed(compose("draft_threshold", overrides=overrides), StudyConfig)


def test_cells_write_rows_resume_and_analyse(tiny, tmp_path):
    for arm in ("none", "keep", "onset"):
        for context in (300, 700):
            assert run_cell(study_cfg(tiny, tmp_path, arm=arm, context=context)) is not None
    assert run_cell(study_cfg(tiny, tmp_path, arm="keep", context=700)) is None  # finished: skipped
    runs = pd.read_csv(tmp_path / "t" / "runs.csv", dtype={"run_id": str})
    assert len(runs) == 6 and runs["run_id"].is_unique
    assert set(runs["arm"]) == {"none", "keep", "onset"}
    assert (runs["new_tokens"] == 24).all() and (runs["decode_tok_s"] > 0).all()
    assert runs["git_commit"].notna().all() and runs["model_sha256"].str.len().eq(64).all()
    started = pd.to_datetime(runs["started_utc"], utc=True)  # ISO times, in the order the cells ran
    assert started.is_monotonic_increasing and runs["sm_clock_mhz"].isna().all()  # CPU: no GPU clock
    keep = runs[(runs["arm"] == "keep") & (runs["context"] == 700)].iloc[0]
    assert keep["capacity_without_draft"] > keep["capacity_with_draft"] >= 1  # the draft costs pages
    onset = runs[(runs["arm"] == "onset") & (runs["context"] == 700)].iloc[0]
    assert onset["ejects"] == 1  # 700 + 24 tokens = 3 pages > the draft-active capacity
    analyze(tmp_path / "t")
    for name in ("steps.csv", "decode_table.csv", "crossover.json", "best_threshold.csv", "draft_thresholds.png"):
        assert (tmp_path / "t" / name).stat().st_size > 0, name
    steps = pd.read_csv(tmp_path / "t" / "steps.csv", dtype={"run_id": str})
    assert set(steps["run_id"]) == set(runs["run_id"])


def test_arms_are_groups_that_set_the_policy_and_the_speculation(tiny, tmp_path):
    cfg = study_cfg(tiny, tmp_path)
    assert cfg.policy.eject == "onset" and arm_of(cfg) == "onset"
    none = study_cfg(tiny, tmp_path, arm="none")
    assert none.spec.type == "none" and arm_of(none) == "none"
    keep = study_cfg(tiny, tmp_path, arm="keep")
    assert keep.policy.eject == "never" and arm_of(keep) == "keep"
    pages = study_cfg(tiny, tmp_path, arm="keep_pages", **{"policy.keep_pages": 12})
    assert (pages.policy.eject, pages.policy.keep_pages, arm_of(pages)) == ("keep_pages", 12, "keep_pages=12")
    with pytest.raises(Exception, match="arm"):  # not an option of conf/arm/
        study_cfg(tiny, tmp_path, arm="eject")
    with pytest.raises(ValueError, match=r"policy.keep_pages=0: give the pages per layer above which keep_pages"):
        study_cfg(tiny, tmp_path, arm="keep_pages", **{"policy.keep_pages": 0})  # before any model is loaded


@pytest.mark.parametrize("override", ["prompt=review", "chat=true", "system=terse"])
def test_generate_prompt_knobs_are_refused_not_ignored(tiny, tmp_path, override):
    """The study builds its own prompt: these would only change the run id (a new 'rep')."""
    key, value = override.split("=")
    with pytest.raises(ValueError, match="the study builds its own prompt"):
        study_cfg(tiny, tmp_path, **{key: value})


def test_size_arena_asks_for_the_pages_it_needs(monkeypatch):
    from experiments import size_arena
    monkeypatch.setattr("sys.argv", ["size_arena", "experiment=draft_threshold_cpu"])
    with pytest.raises(SystemExit, match=r"give \+pages=N, the resident pages per layer wanted .* got None"):
        size_arena.main()


def test_review_prompt_has_exactly_the_asked_tokens(tiny):
    tok = Tokenizer.from_gguf(tiny[0])
    ids = review_prompt(tok, 900, "Review it.")
    assert len(ids) == 900 and tok.decode(ids).rstrip().endswith("assistant")
    with pytest.raises(ValueError, match="context=5 tokens leaves no room"):
        review_prompt(tok, 5, "Review it.")


def _options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


@pytest.mark.parametrize("group", ["model", "hardware", "cache", "arena", "spec", "policy"])
def test_every_group_option_composes(group):
    """A group file sets only what its choice changes; the rest comes from the schema."""
    for option in _options(group):
        if group == "hardware" and option != "cpu":
            continue  # a CUDA device is checked at typing time; the file itself composes below
        with initialize_config_module("conf", version_base=None):
            needs = {("policy", "keep_pages"): ["policy.keep_pages=64"],  # no default
                     ("spec", "mtp"): ["spec.mtp.source=head.gguf"]}.get((group, option), [])
            cfg = compose("generate", overrides=[f"{group}={option}", *needs])
            typed = to_typed(cfg, GenerateConfig)
        # every value the option's file sets reaches the typed config (nested: spec.draft)
        want = OmegaConf.to_container(OmegaConf.load(CONF / group / f"{option}.yaml")) or {}
        got = asdict(getattr(typed, group))
        want.pop("defaults", None)  # another option it extends: checked as that option
        for key, value in want.items():
            for k, v in (value.items() if isinstance(value, dict) else [(None, value)]):
                have = got[key] if k is None else got[key][k]
                assert have == v, (group, option, key, k, have, v)


@pytest.mark.parametrize("experiment", _options("experiment"))
def test_every_experiment_composes(experiment):
    with initialize_config_module("conf", version_base=None):
        cfg = compose("draft_threshold", overrides=[f"experiment={experiment}", "hardware=cpu"])
        typed = to_typed(cfg, StudyConfig)
        grid = compose("draft_threshold", overrides=[f"experiment={experiment}"], return_hydra_config=True)
    # named after its experiment, or after the published folder it is frozen as (draft_threshold_cpu_full)
    assert typed.study == experiment or (CONF.parent / "results" / typed.study).is_dir(), typed.study
    assert grid.hydra.sweeper.params, "an experiment pins its sweep grid"
    arms = str(grid.hydra.sweeper.params.get("arm", "")).split(",")
    assert set(arms) - {""} <= set(_options("arm")), arms
    with initialize_config_module("conf", version_base=None):  # each arm of the grid types, before any model loads
        for arm in filter(None, arms):
            to_typed(compose("draft_threshold", overrides=[f"experiment={experiment}", "hardware=cpu", f"arm={arm}"]),
                     StudyConfig)


def test_the_ppl_config_composes():
    with initialize_config_module("conf", version_base=None):
        assert to_typed(compose("ppl"), PplConfig).ctx >= 3


def test_size_arena_puts_the_onset_where_asked(tiny, tmp_path):
    from experiments.size_arena import arena_for, capacity_with_draft

    cfg = study_cfg(tiny, tmp_path, context=1500)
    mib = arena_for(cfg, 3, generous_mib=8.0)
    assert capacity_with_draft(cfg, mib)[0] == 3
    assert capacity_with_draft(cfg, mib - 0.06)[0] == 2  # one page pair (0.05 MiB) less: one page/layer fewer


def test_gathered_steps_keep_run_ids_that_look_like_numbers(tmp_path):
    """A 12-hex-digit run id such as 187938e31365 reads as a float (here inf) unless read as text."""
    (tmp_path / "steps").mkdir()
    pd.DataFrame({"run_id": ["187938e31365"], "arm": ["none"]}).to_csv(tmp_path / "runs.csv", index=False)
    pd.DataFrame({"step": [0], "step_s": [0.1], "run_id": ["187938e31365"]}).to_csv(
        tmp_path / "steps" / "187938e31365.csv", index=False)
    analyze(tmp_path)  # the tables need more than one row: only the gathering matters here
    assert pd.read_csv(tmp_path / "steps.csv", dtype={"run_id": str})["run_id"].tolist() == ["187938e31365"]


def test_a_row_is_not_appended_under_another_header(tiny, tmp_path):
    """rows.csv written by other code (other columns) is refused, not appended with shifted columns."""
    (tmp_path / "t").mkdir()
    pd.DataFrame({"run_id": ["x"], "tok_per_s": [1.0]}).to_csv(tmp_path / "t" / "runs.csv", index=False)
    with pytest.raises(ValueError, match=r"other columns .* start a new study folder"):
        run_cell(study_cfg(tiny, tmp_path, arm="none", max_new_tokens=4))
    assert not (tmp_path / "t" / "steps").exists()  # refused before decoding anything


def test_rows_of_older_code_gain_the_new_columns_and_are_kept(tmp_path):
    """runs.csv from before a column was added (here beyond_arena_mib) gains it, empty, with
    every row and value as it was (a run id that reads as a number included); then it passes."""
    from experiments.draft_threshold import ROW_COLUMNS, check_columns

    old = [c for c in ROW_COLUMNS if c != "beyond_arena_mib"]
    rows = pd.DataFrame([{c: f"{c}-{i}" for c in old} for i in range(3)]).assign(run_id=["187938e31365", "a", "b"])
    rows.to_csv(tmp_path / "runs.csv", index=False)
    check_columns(tmp_path / "runs.csv")
    got = pd.read_csv(tmp_path / "runs.csv", dtype=str, keep_default_na=False)
    assert tuple(got.columns) == ROW_COLUMNS and (got["beyond_arena_mib"] == "").all()
    assert got[old].equals(rows.astype(str))
    check_columns(tmp_path / "runs.csv")  # now this code's header: nothing to do
    pd.DataFrame({"run_id": ["x"], "decode_tok_s": [1.0], "arm": ["none"]}).to_csv(tmp_path / "other.csv", index=False)
    with pytest.raises(ValueError, match="other columns"):  # ROW_COLUMNS' names, another order: refused
        check_columns(tmp_path / "other.csv")


def test_a_spec_study_gets_its_table_and_figure(tiny, tmp_path):
    """experiment=spec_* rows (arm keep, one spec type per cell) -> spec_table.csv and spec.png:
    acceptance per speculator is accepted / drafted summed over the cell's rounds."""
    from experiments.plot_spec import plot

    for group in ("none", "draft", "ngram-simple-draft"):  # conf/spec/ options
        sure = {} if group == "none" else {"spec.draft.p_min": 0}  # a random tiny draft is never 75% sure
        assert run_cell(study_cfg(tiny, tmp_path, arm="keep", spec=group, context=300, **sure)) is not None
    analyze(tmp_path / "t")  # no keep / eject pair: the sweep's analysis draws the chain figure instead
    assert (tmp_path / "t" / "spec.png").stat().st_size > 0
    plot(tmp_path / "t")
    table = pd.read_csv(tmp_path / "t" / "spec_table.csv")
    runs = pd.read_csv(tmp_path / "t" / "runs.csv")
    assert set(table["spec"]) == set(runs["spec_type"]) == {"none", "draft", "ngram-simple,draft"}
    chain = table[table["spec"] == "ngram-simple,draft"].set_index("speculator")
    assert set(chain.index) == {"ngram-simple", "draft"}
    d = chain.loc["draft"]
    cell = runs[runs["spec_type"] == "ngram-simple,draft"]["run_id"].astype(str).iloc[0]
    steps = pd.read_csv(tmp_path / "t" / "steps" / f"{cell}.csv")
    won = steps[steps["speculator"] == "draft"]  # the rounds the draft proposed, step by step
    assert d["drafted"] == won["drafted"].sum() > 0 and d["accepted"] == won["accepted"].sum()
    assert d["acceptance"] == pytest.approx(won["accepted"].sum() / won["drafted"].sum(), rel=1e-12)  # float division
    assert table[table["spec"] == "none"]["speculator"].tolist() == ["-"]
    # per cell against plain decoding at its context; the draft length is a row key (spec.n_max)
    plain = runs[runs["spec_type"] == "none"]["decode_tok_s"].mean()
    for r in table.itertuples():
        assert r.vs_none == pytest.approx(r.decode_tok_s / plain, rel=1e-12)
        assert r.n_max == (0 if r.spec == "none" else 8)  # the spec groups' draft length (conf/spec/draft.yaml)
    won_ms = 1e3 * won["step_s"].median()  # the draft's rounds in the chain: their median wall time
    assert d["round_ms"] == pytest.approx(won_ms, rel=1e-12) and d["tokens_per_round"] == won["new_tokens"].mean()
    assert (tmp_path / "t" / "spec.png").stat().st_size > 0


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_same_code_is_the_code_paths_not_configs_or_results(tmp_path, monkeypatch):
    """In a throwaway git repository: a later commit that changes only results, docs or a comment in conf/
    runs the same code (a conf change that matters changes the rows' resolved configs, their run ids);
    one that changes kvstream/ does not; nor does a dirty tree."""
    from experiments.common import same_code

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("KVSTREAM_GIT_COMMIT", raising=False)
    git = lambda *args: subprocess.run(["git", *args], check=True, capture_output=True, text=True).stdout.strip()
    git("init", "-q"), git("config", "user.email", "t@t"), git("config", "user.name", "t")
    for f in ("kvstream/m.py", "conf/experiment/e.yaml", "results/r.csv"):
        (tmp_path / f).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / f).write_text("x = 1\n")
    git("add", "."), git("commit", "-qm", "code")
    first = git("rev-parse", "HEAD")
    (tmp_path / "conf/experiment/e.yaml").write_text("x = 1  # a note\n")
    (tmp_path / "results/r.csv").write_text("x = 2\n")
    git("commit", "-qam", "a comment and results")
    assert same_code(first)
    (tmp_path / "kvstream/m.py").write_text("x = 2\n")
    assert not same_code(first)  # uncommitted
    git("commit", "-qam", "code changed")
    assert not same_code(first)


def test_a_fresh_folder_takes_a_published_row_only_of_the_same_code(tiny, tmp_path, monkeypatch):
    """A cell whose row is in results/<study>/ (same resolved config) is copied, steps included, when
    that row's code is this checkout's (a clean tree); otherwise it runs."""
    import experiments.draft_threshold as dt

    assert run_cell(study_cfg(tiny, tmp_path / "pub", arm="none", context=300)) is not None
    published = tmp_path / "pub" / "t" / "runs.csv"
    pd.read_csv(published).assign(git_dirty=False).to_csv(published, index=False)
    monkeypatch.setattr(dt, "PUBLISHED", tmp_path / "pub")
    monkeypatch.setattr(dt, "same_code", lambda commit: True)
    assert run_cell(study_cfg(tiny, tmp_path / "runs", arm="none", context=300, stamp="s1")) is None  # copied
    fresh = tmp_path / "runs" / "t-s1"
    assert pd.read_csv(fresh / "runs.csv")["run_id"].tolist() == pd.read_csv(published)["run_id"].tolist()
    assert len(list((fresh / "steps").glob("*.csv"))) == 1
    (step,) = (tmp_path / "pub" / "t" / "steps").glob("*.csv")  # published as experiments/publish.py does
    write_steps(pd.read_csv(step, dtype={"run_id": str}), step.with_suffix(".csv.gz"))
    step.unlink()
    assert run_cell(study_cfg(tiny, tmp_path / "runs", arm="none", context=300, stamp="s1gz")) is None
    (copied,) = (tmp_path / "runs" / "t-s1gz" / "steps").glob("*.csv")
    pd.testing.assert_frame_equal(pd.read_csv(copied), pd.read_csv(step.with_suffix(".csv.gz")))
    monkeypatch.setattr(dt, "same_code", lambda commit: False)
    assert run_cell(study_cfg(tiny, tmp_path / "runs", arm="none", context=300, stamp="s2")) is not None  # ran
