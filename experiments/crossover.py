"""Keep-vs-eject crossover of a draft-threshold study: measured, and predicted by a step-cost model.

    python -m experiments.crossover results/<study> [--keep keep] [--eject onset]

Reads ``runs.csv`` (one row per decode cell) and ``steps.csv`` (one row per decode step) written by
``experiments/draft_threshold.py`` and writes beside them:
- ``decode_table.csv``: decode tok/s per (arm, context): mean, std, n over reps, and how many code
  versions (``commits``: commit, ``+dirty`` apart) and configs (``configs``, the rep aside) those
  reps ran: a mean over more than one of either is printed as a warning;
- ``crossover.json``: the context where keeping the draft stops paying, measured (bootstrap interval
  over reps) and predicted by a cost model fitted on ``steps.csv``, and their relative error;
- ``best_threshold.csv``: per context, the best fixed arm and how close ``auto`` comes to it.
Contexts are prompt tokens; pages per layer of a crossover are ``context / 256`` (fractional).
A row's arm is named from what it ran (``arm_label`` of its ``policy``, ``keep_pages`` and
``spec_type`` columns), and a threshold arm's pages come from its ``keep_pages`` column.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pandas as pd

from experiments.cost_model import PAGE, CostModel, fit_cost_model, require
from kvstream.speculators.registry import normalize_name

RUN_COLUMNS = ("arm", "context", "rep", "decode_tok_s")
AUTO_GOAL = 0.95  # auto should reach this fraction of the best fixed threshold's tok/s
PREDICTION_GOAL = 0.10  # predicted crossover within this relative error of the measured one


ARM_COLUMNS = ("policy", "keep_pages", "spec_type")  # what names a run's arm (arm_label)
ARM_RANK = {"never": 1, "onset": 2, "always": 3, "keep_pages": 3, "auto": 4}  # by eject policy
FIXED = ("never", "onset", "keep_pages", "always")  # eject policies with a fixed threshold


def arm_label(policy: str, keep_pages, spec_type: str) -> str:
    """A run's arm from what it ran: ``none`` without speculation, else its eject policy, the
    policy never being the arm ``keep`` and keep_pages ``keep_pages=N``; a speculator chain other
    than the draft alone is appended (``keep[ngram-simple,draft]``), one curve per chain."""
    names = [normalize_name(n) for n in str(spec_type).split(",")]
    if names == ["none"]:
        return "none"
    arm = f"keep_pages={int(keep_pages)}" if policy == "keep_pages" else "keep" if policy == "never" else policy
    return arm if names == ["draft"] else f"{arm}[{','.join(names)}]"


def arms(runs: pd.DataFrame) -> pd.DataFrame:
    """One row per arm of ``runs`` (index: its label) with its policy and keep_pages, in order:
    none, keep, onset, always and keep_pages=N by N, auto, then anything else (other chains,
    other policies) by name. ``fixed``: a fixed threshold of the draft alone."""
    require(runs, ("arm", "policy", "keep_pages"), "runs.csv")
    a = runs.drop_duplicates("arm")[["arm", "policy", "keep_pages"]].reset_index(drop=True)
    alone = a["arm"] == [arm_label(p, k, "draft") for p, k in zip(a["policy"], a["keep_pages"])]
    rank = [0 if arm == "none" else ARM_RANK.get(p, 5) if d else 5 for arm, p, d in zip(a["arm"], a["policy"], alone)]
    pages = a["keep_pages"].where(a["policy"] == "keep_pages", -1.0).astype(float)
    a = a.assign(fixed=alone & a["policy"].isin(FIXED), rank=rank, pages=pages)
    return a.sort_values(["rank", "pages", "arm"]).set_index("arm")


def arm_order(runs: pd.DataFrame) -> list[str]:
    """The arms of ``runs`` in ``arms`` order."""
    return list(arms(runs).index)


def step_files(folder: Path) -> list[Path]:
    """A study's per-cell steps: ``steps/<run_id>.csv`` (as the sweep writes them) or ``.csv.gz``
    (as experiments/publish.py publishes them), by name."""
    d = Path(folder) / "steps"
    return sorted([*d.glob("*.csv"), *d.glob("*.csv.gz")])


def read_study(study: Path) -> tuple[pd.DataFrame, pd.DataFrame | None]:
    """runs.csv (required) and steps.csv, or else the per-cell steps files (``step_files``; None
    when neither: no prediction then)."""
    study = Path(study)
    if not (study / "runs.csv").is_file():
        raise FileNotFoundError(f"no runs.csv in {study}: pass the folder experiments/draft_threshold.py wrote")
    runs = pd.read_csv(study / "runs.csv", dtype={"run_id": str, "arm": str})
    require(runs, ARM_COLUMNS, "runs.csv")
    runs["arm"] = [arm_label(*r) for r in runs[list(ARM_COLUMNS)].itertuples(index=False)]
    files = [study / "steps.csv"] if (study / "steps.csv").is_file() else step_files(study)
    steps = pd.concat([pd.read_csv(f, dtype={"run_id": str}) for f in files], ignore_index=True) if files else None
    return runs, steps


def decode_table(runs: pd.DataFrame) -> pd.DataFrame:
    """Mean, std (NaN for one rep) and n of decode tok/s per (arm, context), sorted; with ``commits``
    and ``configs``, the code versions and configs among those reps, where runs.csv records them."""
    require(runs, RUN_COLUMNS, "runs.csv")
    runs = runs.assign(code=_code(runs), cell_config=_cell_config(runs))
    t = runs.groupby(["arm", "context"]).agg(mean=("decode_tok_s", "mean"), std=("decode_tok_s", "std"),
                                             n=("decode_tok_s", "count"), commits=("code", "nunique"),
                                             configs=("cell_config", "nunique")).reset_index()
    t.insert(2, "pages_per_layer", -(-t["context"] // PAGE))
    rank = {a: i for i, a in enumerate(arm_order(runs))}
    t = t.sort_values(["arm", "context"], key=lambda s: s.map(rank) if s.name == "arm" else s)
    return t.reset_index(drop=True)


def _code(runs: pd.DataFrame) -> pd.Series:
    """A row's code version: its commit, ``+dirty`` for an uncommitted tree ("" where not recorded)."""
    if "git_commit" not in runs:
        return pd.Series("", index=runs.index)
    dirty = runs["git_dirty"].astype(str).eq("True") if "git_dirty" in runs else False
    return runs["git_commit"].fillna("").astype(str) + np.where(dirty, "+dirty", "")


def _cell_config(runs: pd.DataFrame) -> pd.Series:
    """A row's resolved config without its rep ("" where not recorded)."""
    if "config" not in runs:
        return pd.Series("", index=runs.index)
    plain = lambda c: json.dumps({k: v for k, v in json.loads(c).items() if k != "rep"}, sort_keys=True)
    return runs["config"].map(lambda c: plain(c) if isinstance(c, str) and c else "")


def mixed(table: pd.DataFrame) -> str | None:
    """A warning when a decode-table mean averages reps of several commits or configs, else None."""
    bad = table[(table["commits"] > 1) | (table["configs"] > 1)]
    if bad.empty:
        return None
    cells = ", ".join(f"{a} at {c}" for a, c in zip(bad["arm"], bad["context"]))
    return (f"warning: {len(bad)} of {len(table)} means average reps of several commits or configs ({cells}): "
            "see decode_table.csv's commits / configs columns")


def eject_threshold(runs: pd.DataFrame, eject: str) -> float:
    """Context (tokens) up to which the eject arm still runs the draft, i.e. equals keep: N pages for
    keep_pages=N, 0 for always, else the onset (the largest capacity_with_draft: the capacity falls slightly with
    context as the decode slab grows); -inf when runs.csv does not say."""
    rows = runs[runs["arm"] == eject]
    policy = rows["policy"].iloc[0] if len(rows) else eject
    if policy == "keep_pages":
        return float(rows["keep_pages"].iloc[0]) * PAGE
    if policy == "always":
        return 0.0
    if "capacity_with_draft" in runs and runs["capacity_with_draft"].notna().any():
        return float(runs["capacity_with_draft"].max()) * PAGE
    return -math.inf


def _crossing(ctx: np.ndarray, d: np.ndarray, above: float):
    """(i, context) of the first change of d = keep - eject from > 0 to <= 0, bracketed by ctx[i],
    ctx[i+1] with ctx[i] > above, linearly interpolated; or None. A bracket that starts at or below
    the eject threshold is skipped: both arms run the same draft there, so d > 0 is noise."""
    for i in range(len(d) - 1):
        if ctx[i] > above and d[i] > 0 >= d[i + 1]:
            return i, ctx[i] + d[i] / (d[i] - d[i + 1]) * (ctx[i + 1] - ctx[i])
    return None


def _locate(keep: str, eject: str, ctx: np.ndarray, d: np.ndarray, above: float) -> dict:
    """The crossover, or None with the side that wins above the threshold and why."""
    hit = _crossing(ctx, d, above)
    if hit is not None:
        i, x = hit
        again = ctx[i + 1:][d[i + 1:] > 0]  # keep may win again far out, once both arms stream
        return dict(context_tokens=x, pages_per_layer=x / PAGE, bracket_tokens=[ctx[i], ctx[i + 1]],
                    keep_wins_again_tokens=again[0] if len(again) else None, winner=None, reason=None)
    over = ctx > above
    lo, hi = (int(ctx[over][0]), int(ctx[-1])) if over.any() else (None, None)
    if not over.any():
        winner, why = None, f"no context above the eject threshold ({above:.0f} tokens)"
    elif (d[over] > 0).all():
        winner, why = keep, f"{keep} is faster at every context above the threshold ({lo}..{hi} tokens)"
    elif (d[over] <= 0).all():
        winner, why = eject, (f"{eject} is as fast or faster at every context above the threshold ({lo}..{hi} "
                              f"tokens); {keep} can win only between the threshold ({above:.0f}) and {lo}")
    else:
        winner, why = None, f"{keep} - {eject} only turns from negative to positive in {lo}..{hi} tokens"
    return dict(context_tokens=None, pages_per_layer=None, winner=winner, reason=why)


def crossover(runs: pd.DataFrame, keep: str = "keep", eject: str = "onset", n_boot: int = 1000,
              seed: int = 0) -> dict:
    """Context (tokens, pages/layer) where mean(keep) - mean(eject) turns from positive to negative
    above the eject threshold, interpolated linearly between the bracketing contexts, with 5/50/95 %
    points of a bootstrap over reps (or the bracketing contexts when every context has one rep)."""
    require(runs, RUN_COLUMNS, "runs.csv")
    reps = {}
    for arm in (keep, eject):
        sub = runs[runs["arm"] == arm]
        if sub.empty:
            raise ValueError(f"no runs with arm {arm!r} (keep/eject arms not found); arms present: "
                             f"{arm_order(runs)}")
        reps[arm] = {c: g.to_numpy(float) for c, g in sub.groupby("context")["decode_tok_s"]}
    ctx = np.array(sorted(set(reps[keep]) & set(reps[eject])), dtype=float)
    if len(ctx) < 2:
        raise ValueError(f"arms {keep!r} and {eject!r} share {len(ctx)} context(s); a crossover needs 2 or more")
    d = np.array([reps[keep][c].mean() - reps[eject][c].mean() for c in ctx])
    above = eject_threshold(runs, eject)
    out = dict(keep=keep, eject=eject, eject_threshold_tokens=above, contexts=ctx.astype(int).tolist(),
               keep_minus_eject=d.tolist()) | _locate(keep, eject, ctx, d, above)
    if out["context_tokens"] is None:
        return out
    lo, hi = out["bracket_tokens"]
    if all(len(reps[a][c]) == 1 for a in (keep, eject) for c in ctx):
        # nothing to resample: all one can say is that the crossover lies between the bracketing contexts
        ci, method, missed = [lo, out["context_tokens"], hi], "bracketing contexts (one rep per context)", 0.0
    else:
        rng = np.random.default_rng(seed)

        def boot_means(v):  # n_boot means of v resampled with replacement
            return v[rng.integers(0, len(v), (n_boot, len(v)))].mean(axis=1)
        D = np.stack([boot_means(reps[keep][c]) - boot_means(reps[eject][c]) for c in ctx], axis=1)
        xs = [h[1] for h in (_crossing(ctx, row, above) for row in D) if h is not None]
        missed = 1 - len(xs) / n_boot
        ci = np.percentile(xs, [5, 50, 95]).tolist() if xs else [None] * 3
        method = f"bootstrap over reps ({n_boot} draws, seed {seed})"
    return out | dict(ci_tokens=ci, ci_pages=[None if v is None else v / PAGE for v in ci], ci_method=method,
                      draws_without_crossing=missed)


def best_threshold(runs: pd.DataFrame) -> pd.DataFrame:
    """Per context: the fastest fixed arm (keep, onset, keep_pages=N, always), plain decoding ("none"), and
    auto against the best fixed arm (goal: ratio >= 0.95) when an "auto" arm exists."""
    wide = decode_table(runs).pivot(index="context", columns="arm", values="mean")
    a = arms(runs)
    fixed = list(a.index[a["fixed"]])
    if not fixed:
        raise ValueError(f"no keep/eject arms found (keep, onset, always, keep_pages=N); arms present: "
                         f"{arm_order(runs)}")
    f = wide[fixed].dropna(how="all")
    out = pd.DataFrame({"context": f.index, "pages_per_layer": -(-f.index // PAGE)})
    out["best_arm"] = f.idxmax(axis=1).to_numpy()  # ties go to the first arm in arm_order
    out["best_tok_s"] = f.max(axis=1).to_numpy()
    out["none_tok_s"] = wide["none"].reindex(f.index).to_numpy() if "none" in wide else np.nan
    if "auto" in wide:
        out["auto_tok_s"] = wide["auto"].reindex(f.index).to_numpy()
        out["auto_ratio"] = out["auto_tok_s"] / out["best_tok_s"]
        out["auto_meets_goal"] = out["auto_ratio"] >= AUTO_GOAL
    return out


def capacity_curve(runs: pd.DataFrame, column: str):
    """Pages per layer that fit, as a function of context (tokens): the median per measured context,
    linear in between and flat outside (the decode slab, so the capacity, changes with context).
    A run reports at most the pages its context needs (prompt + new tokens): such capped values say
    only "everything fits" and are left out; when all are capped nothing streams (infinite)."""
    r = runs.dropna(subset=[column])
    if r.empty:
        raise ValueError(f"runs.csv has no {column} values")
    need = -(-(r["context"] + r.get("new_tokens", 0)) // PAGE)
    per = r[r[column] < need].groupby("context")[column].median()
    if per.empty:
        return lambda ctx: np.full_like(np.asarray(ctx, float), np.inf)
    return lambda ctx: np.interp(ctx, per.index.to_numpy(float), per.to_numpy(float))


SPAN_POINTS = 33  # contexts a decode's span is averaged over (every 128 tokens of a 4096-token decode)


def predicted_crossover(model: CostModel, capacity_with, capacity_without, contexts,
                        eject_pages: float | None = None, new_tokens: int | None = None
                        ) -> tuple[pd.DataFrame, dict]:
    """Keep (draft always) vs eject (draft until pages > eject_pages, default capacity_with, then plain
    decoding with capacity_without resident pages) predicted tok/s per context, and the crossover.
    Capacities are pages per layer, constant or functions of context (``capacity_curve``). With
    ``new_tokens``, each context is the prompt of a decode of that many tokens, as in a measured
    arm: the rates are averaged over the decode's span and the eject arm pays ``model.eject_s``
    once; without it, steady state at the context (a decode long enough to amortise the eject)."""
    cw, cwo = (c if callable(c) else (lambda ctx, c=c: np.full_like(np.asarray(ctx, float), c))
               for c in (capacity_with, capacity_without))
    if math.isnan(model.acceptance):
        raise ValueError("no drafted steps to predict from (the draft proposed nothing in any round)")

    def rates(c, with_, without):  # tok/s with the draft kept / plain at contexts c, given capacities
        pages = c / PAGE
        return (model.tok_s(pages, np.maximum(0, pages - with_), True),
                model.tok_s(pages, np.maximum(0, pages - without), False))

    def curves(c):
        c = np.asarray(c, float)
        if not new_tokens:
            keep, plain = rates(c, cw(c), cwo(c))
            return keep, np.where(c / PAGE > (cw(c) if eject_pages is None else eject_pages), plain, keep)
        # a decode of new_tokens after a prompt of c: the time per token averaged over its span (a
        # 4096-token decode grows the working set by 16 pages) with the prompt's capacities (the
        # cell's layout), the eject paid once if it happens
        span = c[..., None] + np.linspace(0, new_tokens, SPAN_POINTS)
        with_, without = np.asarray(cw(c), float)[..., None], np.asarray(cwo(c), float)[..., None]
        keep_s, plain_s = (1 / r for r in rates(span, with_, without))
        ejected = span / PAGE > (with_ if eject_pages is None else eject_pages)
        eject_total = np.where(ejected, plain_s, keep_s).mean(-1) * new_tokens + model.eject_s * ejected.any(-1)
        return 1 / keep_s.mean(-1), new_tokens / eject_total

    ctx = np.unique(np.asarray(contexts, float))
    keep, eject = curves(ctx)
    table = pd.DataFrame(dict(context=ctx, pages_per_layer=ctx / PAGE, keep_tok_s=keep, eject_tok_s=eject))
    info = dict(eject_pages=eject_pages, new_tokens=new_tokens)
    threshold = float(np.min(cw(ctx))) if eject_pages is None else eject_pages
    found = _locate("keep", "eject", ctx, keep - eject, threshold * PAGE)
    if found["context_tokens"] is None:
        return table, info | found
    lo, hi = found["bracket_tokens"]
    for _ in range(60):  # tok/s is not linear in context: bisect past the grid's interpolation
        mid = (lo + hi) / 2
        k, e = curves(mid)
        lo, hi = (mid, hi) if k - e > 0 else (lo, mid)
    x = (lo + hi) / 2
    return table, info | found | dict(context_tokens=x, pages_per_layer=x / PAGE)


def predict(runs: pd.DataFrame, model: CostModel, eject: str, contexts, steady: bool = False, caps=None
            ) -> tuple[pd.DataFrame, dict]:
    """``predicted_crossover`` for this study's arms: its capacities per context (or ``caps``, a
    (with, without) pair of them), the eject arm's threshold, and (unless ``steady``) the eject
    paid once per decode of the study's length."""
    if caps is None:
        caps = capacity_curve(runs, "capacity_with_draft"), capacity_curve(runs, "capacity_without_draft")
    eject_pages = None if eject == "onset" else eject_threshold(runs, eject) / PAGE
    n_new = runs["new_tokens"].median() if "new_tokens" in runs else math.nan
    n_new = None if steady or math.isnan(n_new) else int(n_new)
    return predicted_crossover(model, *caps, contexts, eject_pages, n_new)


def analyze(runs: pd.DataFrame, steps: pd.DataFrame | None, keep: str = "keep", eject: str = "onset",
            n_boot: int = 1000, seed: int = 0) -> dict:
    """Measured crossover, the cost model's prediction (or why there is none) and their relative error."""
    measured = crossover(runs, keep, eject, n_boot, seed)
    result = dict(measured=measured, predicted=None, cost_model=None, relative_error=None,
                  goal=f"relative error <= {PREDICTION_GOAL}", within_goal=None)
    if steps is None:
        result["predicted"] = dict(context_tokens=None, reason="no steps.csv in the study")
        return result
    try:
        require(runs, ("capacity_with_draft", "capacity_without_draft"), "runs.csv")
        model = fit_cost_model(steps, runs)
        top = 4 * int(runs["context"].max())  # past the measured range too: where keep still wins there
        grid = np.arange(PAGE, top + PAGE, PAGE)
        # what the arms measured (a decode of n_new tokens pays the eject once), and the long-decode limit
        _, predicted = predict(runs, model, eject, grid)
        _, steady = predict(runs, model, eject, grid, steady=True)
        for p in (predicted, steady):
            p["extrapolated"] = p["context_tokens"] is not None and p["context_tokens"] > runs["context"].max()
        result |= dict(predicted=predicted, predicted_steady=steady, cost_model=asdict(model))
    except ValueError as e:
        result["predicted"] = dict(context_tokens=None, reason=str(e))
        return result
    m, p = measured["context_tokens"], predicted["context_tokens"]
    if m is not None and p is not None:
        result["relative_error"] = abs(p - m) / m
        result["within_goal"] = result["relative_error"] <= PREDICTION_GOAL
    return result


def _jsonable(v):
    if isinstance(v, dict):
        return {k: _jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if isinstance(v, (np.integer, np.floating, np.bool_)):
        v = v.item()
    return None if isinstance(v, float) and math.isnan(v) else v


def describe(side: dict) -> str:
    if side.get("context_tokens") is None:
        return f"none ({side.get('reason')})"
    s = f"{side['context_tokens']:.0f} tokens ({side['pages_per_layer']:.1f} pages/layer)"
    if side.get("ci_tokens") and side["ci_tokens"][0] is not None:
        lo, mid, hi = side["ci_tokens"]
        s += f", 5/50/95%: {lo:.0f} / {mid:.0f} / {hi:.0f} tokens [{side['ci_method']}]"
    return s


def write(study: Path, keep: str = "keep", eject: str = "onset", n_boot: int = 1000, seed: int = 0) -> dict:
    """The study's tables and crossover.json, written beside its runs.csv and printed; raises
    FileNotFoundError / ValueError on a folder that cannot give them."""
    study = Path(study)
    runs, steps = read_study(study)
    table, best = decode_table(runs), best_threshold(runs)
    result = _jsonable(analyze(runs, steps, keep, eject, n_boot, seed))
    table.to_csv(study / "decode_table.csv", index=False)
    best.to_csv(study / "best_threshold.csv", index=False)
    (study / "crossover.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"decode tok/s per arm and context ({study})\n{table.to_string(index=False, float_format='%.2f')}\n")
    if mixed(table):
        print(mixed(table))
    print(f"best fixed threshold per context\n{best.to_string(index=False, float_format='%.3f')}\n")
    print(f"crossover {keep} -> {eject}")
    print(f"  measured:  {describe(result['measured'])}")
    print(f"  predicted: {describe(result['predicted'])}")
    if result["relative_error"] is not None:
        print(f"  relative error {result['relative_error']:.1%} (goal <= {PREDICTION_GOAL:.0%})")
    print(f"wrote decode_table.csv, best_threshold.csv, crossover.json in {study}")
    return result


def add_arm_args(ap: argparse.ArgumentParser) -> None:
    """The arms compared and the bootstrap's draws and seed, as the analyses' command lines take them."""
    ap.add_argument("--keep", default="keep")
    ap.add_argument("--eject", default="onset")
    ap.add_argument("--n-boot", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("study", type=Path, help="results/<study> holding runs.csv and steps.csv")
    add_arm_args(ap)
    args = ap.parse_args(argv)
    try:
        write(args.study, args.keep, args.eject, args.n_boot, args.seed)
    except (FileNotFoundError, ValueError) as e:  # no study there, too few contexts, missing arms or columns
        raise SystemExit(f"crossover: {e}") from None


if __name__ == "__main__":
    main()
