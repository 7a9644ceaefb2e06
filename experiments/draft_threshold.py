"""Draft-threshold study: decode speed per eject arm and context, one Hydra cell per run.

    python -m experiments.draft_threshold --multirun experiment=draft_threshold_cpu

A cell is (arm, context, rep): the prompt is ``context`` tokens of source code (Python
standard-library modules) followed by a review instruction, in the model's chat template;
then ``max_new_tokens`` at the configured sampling (T = 0 in the studies). An arm is a config
group (``conf/arm/``) that sets the speculation and the eject policy:

- ``none``: no speculation;            - ``keep``: the draft is never ejected (policy never);
- ``onset``: eject at the streaming onset; - ``keep_pages``: eject above ``policy.keep_pages``;
- ``auto``: the goodput-measuring policy;  - ``always``: eject at the first batch.

runs.csv names each row's arm from what it ran (``experiments.crossover.arm_label`` of its
``policy``, ``keep_pages`` and ``spec_type`` columns), as the analysis does.

The study folder: a fresh sweep writes to ``runs/<study>-<UTC stamp>/`` (untracked), never to a
published ``results/`` folder; ``study=``, ``results=`` or ``stamp=`` choose another (a folder of
``results/`` only when asked). Each cell appends one row to the folder's ``runs.csv`` (full
resolved config and provenance) and writes its per-step records to ``steps/<run_id>.csv``. A
cell whose row is in the folder is skipped, so a killed sweep resumes where it stopped (Ctrl-C
says how: the same command with the folder's ``stamp=``); a row of the published
``results/<study>/`` is reused only when its config is the cell's and its code is this checkout's
(``common.same_code``). When the sweep ends, ``Analyze`` gathers ``steps.csv`` and runs
``experiments.crossover`` and ``experiments.plot_draft_thresholds`` over the folder.
"""

from __future__ import annotations

import functools
import gc
import hashlib
import json
import re
import sys
import traceback
from dataclasses import asdict, dataclass, replace
from datetime import datetime, timezone
from pathlib import Path

import hydra
import pandas as pd
import torch
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from experiments.common import load_target, provenance, review_prompt, same_code
from experiments.crossover import arm_label
from kvstream.cli import errors
from kvstream.config import GenerateConfig, quote_free_text, register_schema, to_typed
from kvstream.engine.gpu_clock import ClockSampler
from kvstream.model.loader import is_skeleton, open_gguf
from kvstream.model.registry import resolve_model
from kvstream.engine.runner import run_decode


@dataclass
class StudyConfig(GenerateConfig):
    study: str = "draft_threshold"  # the study's name; its folder is <results>/<study>[-<stamp>]/
    results: str = "runs"      # untracked; results/ holds the published folders
    stamp: str = ""            # a fresh sweep's UTC start (main sets it unless study=, results= or stamp= is given)
    context: int = 1024        # prompt tokens: source code + the review instruction
    rep: int = 0               # repetition index (a separate cell)
    instruction: str = "Review the code above: point out bugs, unclear names and missing tests."
    progress: bool = True      # a tqdm bar per cell's decode
    prompt: str = ""           # generate's knob (as chat and system): refused set, see below
    max_new_tokens: int = 256
    ignore_eos: bool = True    # every cell decodes the same number of tokens

    def __post_init__(self):
        super().__post_init__()
        # generate's prompt knobs: a study cell's prompt is always `context` tokens of source code and the
        # instruction in the chat template; set here they would change nothing but the run id
        if self.prompt or self.chat or self.system is not None:
            raise ValueError(f"prompt={self.prompt!r}, chat={self.chat}, system={self.system!r}: the study builds its "
                             "own prompt (source code + instruction, chat template); set context= and instruction=")

    @property
    def folder(self) -> Path:
        return study_folder(self.results, self.study, self.stamp)


def study_folder(results: str, study: str, stamp: str) -> Path:
    return Path(results) / (f"{study}-{stamp}" if stamp else study)


OmegaConf.register_new_resolver("study_folder", lambda *a: str(study_folder(*a)), replace=True)  # hydra.sweep.dir
PUBLISHED = Path(__file__).resolve().parents[1] / "results"
_sweep: dict = {}  # this process's folder and cells run, for the Ctrl-C line


# runs.csv's columns, in order (``run_cell`` builds its row with exactly these)
ROW_COLUMNS = ("run_id", "study", "arm", "policy", "keep_pages", "spec_type", "context", "rep", "new_tokens",
               "decode_tok_s", "prefill_tok_s", "capacity_with_draft", "capacity_without_draft", "draft_mib", "ejects",
               "reenables", "transitions", "acceptance_rate", "draft_time_share", "wait_time_share",
               "speculators",
               "synthetic_acceptance", "random_weights", "arena_mib", "arena_bytes", "beyond_arena_mib",
               "end_beyond_arena_mib", "started_utc",
               "sm_clock_mhz", "sm_clock_min_mhz", "model",
               "model_sha256", "draft_model", "device", "dtype", "prompt_sha1", "git_commit", "git_dirty",
               "device_name", "torch", "triton", "python", "config")


def check_columns(runs: Path) -> None:
    """``runs`` must have this code's columns. Rows written by older code, whose columns are some
    of these in the same order, gain the new ones (empty: not measured then), every row kept;
    any other header is refused, rather than rows appended under shifted columns."""
    have = tuple(pd.read_csv(runs, nrows=0).columns)
    if have == ROW_COLUMNS:
        return
    if set(have) < set(ROW_COLUMNS) and list(have) == [c for c in ROW_COLUMNS if c in have]:
        rows = pd.read_csv(runs, dtype={"run_id": str}, keep_default_na=False)
        tmp = runs.with_suffix(".csv.tmp")
        rows.reindex(columns=list(ROW_COLUMNS)).to_csv(tmp, index=False)
        tmp.replace(runs)  # whole or not at all
        print(f"{runs}: written by older code; added the columns {[c for c in ROW_COLUMNS if c not in have]} "
              f"(empty for its {len(rows)} rows)", flush=True)
        return
    raise ValueError(f"{runs} has other columns than this code writes (only there: "
                     f"{sorted(set(have) - set(ROW_COLUMNS))}, only here: {sorted(set(ROW_COLUMNS) - set(have))}): "
                     f"start a new study folder (study=...)")


def run_cell(cfg: StudyConfig) -> dict | None:
    """Run one cell unless its row exists; returns the row (None: skipped, or reused from results/)."""
    out = cfg.folder
    _sweep.setdefault("folder", out)
    arm = arm_of(cfg)
    resolved = asdict(cfg)
    for key in ("progress", "results", "stamp"):  # where rows go and how they show: not part of the cell
        resolved.pop(key)
    run_id = hashlib.sha1(json.dumps(resolved, sort_keys=True, default=str).encode()).hexdigest()[:12]
    runs = out / "runs.csv"
    if runs.exists():  # before any decoding
        check_columns(runs)
    if runs.exists() and run_id in set(pd.read_csv(runs, usecols=["run_id"], dtype=str)["run_id"]):
        print(f"[{cfg.study}] arm={arm} context={cfg.context} rep={cfg.rep}: done before ({run_id}), skipped")
        return None
    if reuse_published(cfg.study, run_id, out):
        print(f"[{cfg.study}] arm={arm} context={cfg.context} rep={cfg.rep}: reused {PUBLISHED.name}/{cfg.study}'s "
              f"row ({run_id}: same config, same code)")
        return None
    model, tok, sha = load_target(cfg)
    prompt = review_prompt(tok, cfg.context, cfg.instruction)
    if model.device.type == "cuda":  # Triton compiles per kernel variant (widths, rounds): never in a timed cell
        run_decode(replace(cfg, max_new_tokens=24), model, tok, prompt)
    print(f"[{cfg.study}] arm={arm} context={cfg.context} rep={cfg.rep} ...", flush=True)
    held = _held_before(model.device)
    free = torch.cuda.mem_get_info(model.device)[0] if held is not None else None
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    with ClockSampler(model.device) as clock:
        r = run_decode(cfg, model, tok, prompt, progress=cfg.progress)
    # the device's own count (torch's counts a slab pool's segments, which lie in the arena, twice),
    # while the run's cache and draft are still alive
    used = None if held is None else free - torch.cuda.mem_get_info(model.device)[0]
    if clock.note and model.device.type == "cuda":
        print(f"[{cfg.study}] {clock.note}", flush=True)
    g, c = r.generation, r.control
    steps = pd.DataFrame([s.row() for s in g.records]).assign(run_id=run_id)
    (out / "steps").mkdir(parents=True, exist_ok=True)
    steps.to_csv(out / "steps" / f"{run_id}.csv", index=False)
    stats = r.chain.stats() if r.chain else {}
    drafted = sum(s.drafted_tokens for s in stats.values())
    row = {
        "run_id": run_id, "study": cfg.study, "arm": arm, "policy": cfg.policy.eject,
        "keep_pages": cfg.policy.keep_pages if cfg.policy.eject == "keep_pages" else None,
        "spec_type": cfg.spec.type, "context": cfg.context, "rep": cfg.rep, "new_tokens": g.stats.new_tokens,
        "decode_tok_s": g.stats.decode_tok_s, "prefill_tok_s": g.stats.prefill_tok_s,
        "capacity_with_draft": c.capacity_with if c else None,
        "capacity_without_draft": c.capacity_without if c else r.cache.capacity,
        "draft_mib": c.bytes / 2**20 if c else 0.0, "ejects": c.count("eject") if c else 0,
        "reenables": c.count("reenable") if c else 0,
        "transitions": json.dumps(c.transitions_rows() if c else []),  # step, pages, capacities, seconds, bytes
        "acceptance_rate": sum(s.accepted_tokens for s in stats.values()) / drafted if drafted else None,
        "draft_time_share": float(steps["draft_s"].sum() / steps["step_s"].sum()) if len(steps) else None,
        # the target passes' transfer wait (device time on CUDA); empty where the cache did not time it
        "wait_time_share": float(steps["wait_s"].sum() / steps["step_s"].sum())
        if len(steps) and steps["wait_s"].notna().all() else None,
        "speculators": json.dumps({n: s.as_dict() for n, s in stats.items()}),  # per speculator, fixed schema
        "synthetic_acceptance": cfg.spec.synthetic_acceptance, "random_weights": random_weights(cfg.model.source),
        "arena_mib": cfg.arena.mib, "arena_bytes": r.cache.arena.nbytes,
        "beyond_arena_mib": None if held is None else (torch.cuda.max_memory_reserved() - held - r.cache.arena.nbytes) / 2**20,
        "end_beyond_arena_mib": None if held is None else (used - r.cache.arena.nbytes) / 2**20,
        "started_utc": started,  # with the clock: whether a slow cell's GPU ran slower, or beside what
        **{k: v for k, v in clock.summary().items() if k in ("sm_clock_mhz", "sm_clock_min_mhz")},
        "model": cfg.model.source, "model_sha256": sha,
        "draft_model": cfg.spec.draft.source if c else None, "device": cfg.hardware.device,
        "dtype": cfg.hardware.dtype, "prompt_sha1": hashlib.sha1(str(prompt).encode()).hexdigest()[:12],
        **provenance(), "config": json.dumps(resolved, sort_keys=True, default=str),
    }
    if tuple(row) != ROW_COLUMNS:  # appending would shift columns
        raise RuntimeError(f"run_cell's row and ROW_COLUMNS disagree: {sorted(set(row) ^ set(ROW_COLUMNS))}")
    pd.DataFrame([row]).to_csv(runs, mode="a", header=not runs.exists(), index=False)  # the row marks it done
    _sweep["ran"] = _sweep.get("ran", 0) + 1
    print(f"[{cfg.study}] arm={arm} context={cfg.context}: {g.stats.line()}", flush=True)
    return row


@functools.cache
def random_weights(source: str) -> bool:
    """Whether ``source`` is a skeleton GGUF (seeded random weights); once per process, since
    reading a GGUF's metadata (its vocabulary) takes seconds."""
    return is_skeleton(open_gguf(resolve_model(source)))


def reuse_published(study: str, run_id: str, out: Path) -> bool:
    """Copy the published ``results/<study>/`` row ``run_id`` (same resolved config) and its steps
    into ``out`` when that row's code is this checkout's; True if it did."""
    src = PUBLISHED / study
    if not (src / "runs.csv").is_file() or src.resolve() == out.resolve():
        return False
    rows = pd.read_csv(src / "runs.csv", dtype={"run_id": str}, keep_default_na=False)
    rows = rows[(rows["run_id"] == run_id) & (rows["git_dirty"].astype(str) == "False")]
    rows = rows[[same_code(c) for c in rows["git_commit"]]]
    steps = [f for f in (src / "steps" / f"{run_id}.csv", src / "steps" / f"{run_id}.csv.gz") if f.is_file()]
    if rows.empty or not steps:
        return False
    (out / "steps").mkdir(parents=True, exist_ok=True)
    pd.read_csv(steps[0], dtype={"run_id": str}).to_csv(out / "steps" / f"{run_id}.csv", index=False)
    runs = out / "runs.csv"
    if runs.exists():
        check_columns(runs)
    rows.iloc[:1].reindex(columns=list(ROW_COLUMNS)).to_csv(runs, mode="a", header=not runs.exists(), index=False)
    return True


def _held_before(device: torch.device) -> int | None:
    """CUDA: what torch holds before a cell's run (the weights; the warm-up's freed blocks are
    given back first), the peak count restarted. The run's peak beyond this and its arena is
    ``beyond_arena_mib``, from torch's peak count: the logits handed to the sampler, the setup's
    reserve passes, which measure the slabs in segments of their own (transient), and the slab
    pools' segments, which lie inside the arena but count as torch segments too.
    ``end_beyond_arena_mib``, from the device's free memory (no double count): what
    the run holds beyond its arena at its end (the draft's compute buffers and captured graphs are
    in its slabs, inside the arena). Neither counts the cuBLAS workspaces of the streams that ran
    matmuls (the compute stream and the one capture stream, ``kvstream.cache.streams.side_stream``): the
    cell's warm-up made them, for the process's lifetime."""
    if device.type != "cuda":
        return None
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    return torch.cuda.memory_reserved()


def arm_of(cfg) -> str:
    """The arm a cell runs (a typed or a Hydra config), as runs.csv and the analysis name it."""
    p = cfg.policy
    return arm_label(p.eject, p.keep_pages if p.eject == "keep_pages" else None, cfg.spec.type)


class Analyze(Callback):
    """Before a sweep: its config as composed (each cell's, its sweep values aside) checked, so that
    a bad value fails before Hydra writes the folder; after: gather steps.csv, then the crossover
    tables and the figure."""

    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        errors.task(check_sweep)(OmegaConf.masked_copy(config, [k for k in config if k != "hydra"]))

    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:
        analyze(study_folder(config.results, config.study, config.stamp))


def check_sweep(cfg: DictConfig) -> None:
    """The sweep's config and its folder's runs.csv, before anything is written (a known error
    leaves through ``errors.task`` as a UserError, which Hydra's callback guard lets through)."""
    runs = to_typed(cfg, StudyConfig).folder / "runs.csv"
    if runs.exists():
        check_columns(runs)


def analyze(study: Path) -> None:
    from experiments import crossover, plot_draft_thresholds

    files = sorted((study / "steps").glob("*.csv"))
    if not (study / "runs.csv").exists() or not (files or (study / "steps.csv").exists()):
        print(f"no finished cells in {study}: nothing to analyse")
        return
    if files:  # else a steps.csv gathered elsewhere (the per-cell files were not kept)
        pd.concat([pd.read_csv(f, dtype={"run_id": str}) for f in files]).to_csv(study / "steps.csv", index=False)
    try:
        crossover.write(study)
        print("figure:", plot_draft_thresholds.plot(study))
    except ValueError as e:  # e.g. a sweep without both a keep and an eject arm
        print(f"analysis of {study} incomplete: {e}")
        specs = pd.read_csv(study / "runs.csv").get("spec_type")
        if specs is not None and specs.nunique() > 1:  # a speculator-chain study
            from experiments import plot_spec

            print("speculator-chain figure:", plot_spec.plot(study))


@hydra.main(version_base=None, config_path="pkg://conf", config_name="draft_threshold")
@errors.task
def _main(cfg: DictConfig) -> None:
    try:
        run_cell(to_typed(cfg, StudyConfig))
    except errors.KNOWN:  # a bad value or folder: every cell would fail the same way, the sweep stops
        raise
    except Exception as e:
        # say so now, not when the sweep ends, and raise an error that holds no frames: Hydra keeps
        # every failed cell's exception until the sweep ends, and the frames of its traceback (and
        # of any exception chained to it) hold the cell's arena and caches
        cell = f"[{cfg.study}] arm={arm_of(cfg)} context={cfg.context} rep={cfg.rep}"
        print(f"{cell} failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        raise RuntimeError(f"{cell} failed: {type(e).__name__}: {e}") from None


register_schema("draft_threshold_schema", StudyConfig)


def interrupted() -> str:
    folder = _sweep.get("folder")
    if folder is None:
        return "interrupted before the first cell: nothing written"
    done = len(pd.read_csv(folder / "runs.csv", usecols=["run_id"])) if (folder / "runs.csv").exists() else 0
    again = f" plus stamp={_sweep['stamp']}" if "stamp" in _sweep else ""
    return (f"interrupted: {done} cells done in {folder} ({_sweep.get('ran', 0)} run now); the same command{again} "
            "resumes with the next")


def main() -> None:
    quote_free_text(sys.argv, ("instruction", "spec.type"))
    if not any(re.match(r"[+~]*(study|results|stamp)=", a) for a in sys.argv[1:]):  # a fresh folder
        _sweep["stamp"] = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
        last = max((i for i, a in enumerate(sys.argv) if "=" in a and not a.startswith("-")), default=len(sys.argv) - 1)
        sys.argv.insert(last + 1, f"stamp={_sweep['stamp']}")  # beside the overrides: argparse wants them together
    errors.main("draft_threshold", _main, interrupted)


if __name__ == "__main__":
    main()
