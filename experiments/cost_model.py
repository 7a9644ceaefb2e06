"""The step-cost model of a draft-threshold study: what a target step, a drafting round and an
eject cost, fitted to the per-step records (``steps.csv``) that experiments/draft_threshold.py
writes. experiments/crossover.py predicts the keep/eject crossover from it.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import numpy as np
import pandas as pd

from kernels.formats import PAGE_TOKENS as PAGE

STEP_COLUMNS = ("step_s", "draft_s", "streamed_pages", "verify_width", "pages_per_layer", "drafted", "accepted",
                "draft_active")


def require(df: pd.DataFrame, columns, what: str) -> None:
    missing = [c for c in columns if c not in df.columns]
    if missing:
        raise ValueError(f"{what} lacks column(s) {missing}; it has {list(df.columns)}")


@dataclass(frozen=True)
class CostModel:
    """Target verify seconds = max(a + b*streamed_pages + c*(verify_width - 1) + d*pages_per_layer,
    e + f*streamed_pages, copy_floor*streamed_pages): a compute line, and a copy line for steps whose
    streamed pages take longer to copy than the layers' compute they overlap (f: seconds per streamed
    page per layer, all layers; e = f = 0 when no step was copy-bound or the study has under 10 design
    points). ``copy_floor`` (with a copy line): the fewest seconds per streamed page of any streaming
    design point (the copy-bound ones at the most pages), below which the copy line may not extrapolate:
    a copy's rate climbs with its size towards the link's, so the line fitted over the climb is flatter
    than the copy-bound steps beyond (on the H100 final6's line gave 52.6 us a page, the steps past its
    grid took 66-67 us); no measured point lies below it. A round with the
    draft active drafts ``drafted_per_round`` tokens on average (rounds where it proposes nothing
    included) in ``draft_s_per_round`` seconds and keeps ``tokens_per_round`` (1 + the mean accepted
    drafts), all as measured over the study; with several prompt lengths, per prompt length too
    (``round_*``, interpolated in context, flat outside: a real draft's acceptance and time change
    with the text and its KV window). ``acceptance`` (per token) is reported beside. An eject costs ``eject_s`` once: the arena's re-layout
    (``eject_seconds``) and the extra time of the steps after it that still pay for it
    (``eject_cost``: graphs captured for the new layout). A state that streams pays ``page_s`` once
    per page of tokens (``page_cost``: the new plan, its captured copies re-pointed, or a capture
    where the step's shape changes).
    rms_residual_s: over design-point medians."""
    a: float
    b: float
    c: float
    d: float
    acceptance: float
    drafted_per_round: float
    draft_s_per_round: float
    tokens_per_round: float
    n_steps: int
    rms_residual_s: float
    eject_s: float = 0.0
    e: float = 0.0
    f: float = 0.0
    round_contexts: tuple = ()  # prompt lengths (tokens), ascending, and their round statistics
    round_drafted: tuple = ()
    round_draft_s: tuple = ()
    round_tokens: tuple = ()
    page_s: float = 0.0
    # with a fixed ring, the page cost per streaming-round count (a plan of more rounds captures a
    # larger graph): page_rounds[i] rounds cost page_s_rounds[i] (interpolated, flat beyond the
    # ends); rounds from ring_round_pages streamed pages per round. Empty: page_s for every count
    page_rounds: tuple = ()
    page_s_rounds: tuple = ()
    ring_round_pages: float = math.inf
    copy_floor: float = 0.0  # seconds per streamed page no copy-bound step beats (0: no copy line)

    def page_seconds(self, streamed_pages):
        """The per-page cost of a state streaming ``streamed_pages`` pages per layer (0: none)."""
        streamed = np.asarray(streamed_pages, float)
        if not self.page_rounds:
            return np.where(streamed > 0, self.page_s, 0.0)
        rounds = np.maximum(1, np.ceil(streamed / self.ring_round_pages))
        return np.where(streamed > 0, np.interp(rounds, self.page_rounds, self.page_s_rounds), 0.0)

    def rounds(self, pages):
        """(drafted, draft seconds, kept tokens) per round at ``pages`` pages per layer."""
        if len(self.round_contexts) < 2:
            return self.drafted_per_round, self.draft_s_per_round, self.tokens_per_round
        ctx = np.asarray(pages, float) * PAGE
        return tuple(np.interp(ctx, self.round_contexts, v)
                     for v in (self.round_drafted, self.round_draft_s, self.round_tokens))

    def target_s(self, pages, streamed_pages, width):
        compute = self.a + self.b * streamed_pages + self.c * (width - 1) + self.d * pages
        return _bound(compute, self.e, self.f, np.asarray(streamed_pages, float), self.copy_floor)

    def tok_s(self, pages, streamed_pages, draft: bool):
        """Predicted decode tokens/s with or without the draft (numpy arrays broadcast)."""
        per_page = self.page_seconds(streamed_pages) / PAGE
        if not draft:
            return 1.0 / (self.target_s(pages, streamed_pages, 1) + per_page)
        drafted, draft_s, tokens = self.rounds(pages)
        return 1.0 / ((self.target_s(pages, streamed_pages, 1 + drafted) + draft_s) / tokens + per_page)


def acceptance_per_token(drafting: pd.DataFrame) -> float:
    """Maximum-likelihood per-token acceptance of drafting rounds: a round accepts its drafted
    tokens up to the first rejection, so every accepted token is a success and a round that
    stopped short adds one failure; accepted / drafted would also count the tokens after a
    rejection, which were never tried (at alpha 0.7 and 8 drafted that is 0.28, not 0.7)."""
    acc = drafting["accepted"]
    tries = acc + (acc < drafting["drafted"])
    return float(acc.sum() / tries.sum()) if tries.sum() else math.nan


def eject_seconds(runs: pd.DataFrame) -> float:
    """Median duration of the ejects themselves (the arena's re-layout; runs.csv ``transitions``):
    they run between two steps, so no step's step_s holds them. 0 when no run ejected; cells that
    are not a JSON list of transitions are skipped."""
    secs = []
    for cell in runs.get("transitions", pd.Series(dtype=object)).dropna():
        try:
            rows = json.loads(cell) if isinstance(cell, str) else None
        except ValueError:
            continue
        secs += [t["seconds"] for t in rows or [] if isinstance(t, dict) and t.get("action") == "eject"
                 and isinstance(t.get("seconds"), (int, float))]
    return float(np.median(secs)) if secs else 0.0


def eject_cost(steps: pd.DataFrame) -> float:
    """Median over ejects of the extra time the steps after one take while they still pay for it
    (``after_transition``: graphs re-captured for the new layout), against the median of the run's
    other plain steps; 0 when nothing ejected or the steps do not say."""
    if not {"run_id", "draft_active", "verify_width"} <= set(steps.columns):
        return 0.0
    steps = steps.assign(_paying=after_transition(steps))
    costs = []
    for _, run in steps.groupby("run_id", sort=False):
        active = run["draft_active"].astype(bool).to_numpy()
        plain = run.loc[~active & (run["verify_width"] == 1).to_numpy() & ~run["_paying"].to_numpy(), "step_s"]
        if plain.empty:
            continue
        for i in np.flatnonzero(active[:-1] & ~active[1:]) + 1:  # the first step without the draft
            j = i
            while j < len(run) and run["_paying"].iloc[j] and not active[j]:
                j += 1
            costs.append(float((run["step_s"].iloc[i:j] - plain.median()).sum()))
    return float(np.median(costs)) if costs else 0.0


def in_place(steps: pd.DataFrame) -> pd.Series:
    """The plain steps that measured the ejected state with the draft pinned (``plain_measure``;
    False where steps.csv predates the column)."""
    if "plain_measure" not in steps:
        return pd.Series(False, index=steps.index)
    return steps["plain_measure"].astype("boolean").fillna(False).astype(bool)


def target_seconds(steps: pd.DataFrame) -> pd.Series:
    """The target's part of each step. A round with the draft ejected, or measuring the ejected
    state in place, runs the host a step ahead: its draft_s (the chain's bookkeeping) overlaps
    the device's step instead of preceding it, so its whole wall time is the target's."""
    return steps["step_s"] - steps["draft_s"] * (steps["draft_active"].astype(bool) & ~in_place(steps))


def page_costs(steps: pd.DataFrame, paying: pd.Series) -> dict:
    """``page_cost`` per streaming-round count (the steps' ``rounds``), for ``CostModel``'s
    ``page_rounds`` / ``page_s_rounds``; {} when the steps do not say."""
    extra = _opening_extras(steps, paying)
    if "rounds" not in steps or extra.empty:
        return {}
    by = extra.groupby(steps.loc[extra.index, "rounds"].astype(int)).mean().clip(lower=0.0)
    return dict(page_rounds=tuple(map(int, by.index)), page_s_rounds=tuple(map(float, by)))


def page_cost(steps: pd.DataFrame, paying: pd.Series) -> float:
    """Mean extra target time of the steps that open a page while pages stream (when the plan's
    copies change, the plan is made and the captured copies re-pointed, ~1-2 ms on the H200, or
    the step captured where its shape changes, ~40-50 ms; a mean, since with
    ``cache.residency_step`` k only one opening in k changes the plan), over the median step of
    the same run and design point; steps that still pay a
    transition (``paying``) left out. 0 when no such step, or the steps do not say."""
    extra = _opening_extras(steps, paying)
    return max(0.0, float(extra.mean())) if len(extra) else 0.0


def _opening_extras(steps: pd.DataFrame, paying: pd.Series) -> pd.Series:
    """``page_cost``'s steps (those opening a page while pages stream) and their extra seconds."""
    if not {"run_id", "context"} <= set(steps.columns):
        return pd.Series(dtype=float)
    active = steps["draft_active"].astype(bool)
    s = steps.assign(target_s=target_seconds(steps))
    point = [s["run_id"], s["streamed_pages"], s["verify_width"], s["pages_per_layer"]]
    by = s.groupby(point)["target_s"]
    extra = s["target_s"] - by.transform("median")
    # the round that launched the page's first step: a plain round queues the next step (CUDA
    # run-ahead), so it opens the page one token early
    launched = -(-(s["context"] + (~active | in_place(steps))) // PAGE)
    opens = launched > launched.groupby(s["run_id"]).shift()
    return extra[opens & (s["streamed_pages"] > 0) & ~paying & (by.transform("size") >= 3)]


def after_transition(steps: pd.DataFrame, n: int = 2) -> pd.Series:
    """True for the steps of a run that follow its draft's eject or re-enable and still pay for it:
    the first ``n`` (the draft's catch-up) and the first of each verify width (a new layout, so the
    width's CUDA graph is captured then). One-off costs of tens of ms, which ``eject_s`` counts for
    an eject, not steady rounds (a 79 ms capture of a lone 2-token round bent the fit)."""
    if "run_id" not in steps:
        return pd.Series(False, index=steps.index)
    run, active = steps["run_id"], steps["draft_active"].astype(bool)
    flip = (active != active.groupby(run).shift()) & run.duplicated()
    stint = flip.astype(int).groupby(run).cumsum()  # transitions so far in the run
    first = steps.groupby([run, stint]).cumcount()  # the step's index within its stint
    new_width = ~pd.DataFrame({"r": run, "s": stint, "w": steps["verify_width"]}).duplicated()
    return (stint > 0) & ((first < n) | new_width)


def _bound(compute, e: float, f: float, streamed, floor: float = 0.0):
    """The step time: the compute line, or the copy line (not below ``floor`` seconds per streamed
    page) where that is longer and pages stream (with nothing streamed there is no copy; f = 0: no
    copy line)."""
    if f <= 0:
        return compute
    return np.where(streamed > 0, np.maximum(compute, np.maximum(e + f * streamed, floor * streamed)), compute)


def _wlstsq(X: np.ndarray, y: np.ndarray, w: np.ndarray):
    coef, _, rank, _ = np.linalg.lstsq(X * w[:, None], y * w, rcond=None)
    return coef, rank


def _fit_lines(g: pd.DataFrame, n_steps: int, s: pd.DataFrame):
    """The compute line on every design point, or, where it explains the medians better (BIC, the
    split point counted as a parameter), the compute line below a streamed-pages split and a copy line
    above it, the two combined by max (streaming overlaps the compute until the copy takes longer:
    on the H200 a verify step's time rose 13-29 us per streamed page up to ~44, then 61 us, the pinned
    copy rate). Returns the compute coefficients, (e, f), the copy floor (the fewest seconds per
    streamed page of the medians; 0 without a copy line) and the model's medians."""
    y, w = g["median"].to_numpy(), np.sqrt(g["size"].to_numpy(float))
    streamed = g["streamed_pages"].to_numpy(float)
    X = np.column_stack([np.ones(len(g)), streamed, g["verify_width"] - 1, g["pages_per_layer"]])
    coef, rank = _wlstsq(X, y, w)
    if rank < 4:
        flat = [n for n in ("streamed_pages", "verify_width", "pages_per_layer") if s[n].nunique() < 2]
        raise ValueError(f"steps.csv ({n_steps} complete steps) cannot separate the cost terms: "
                         f"{'constant ' + str(flat) if flat else 'collinear streamed_pages / pages_per_layer'}; "
                         f"the study needs contexts below and above the capacities")
    n, wn = len(g), w ** 2 / np.mean(w ** 2)  # weights normalised to n points

    def bic(pred, k):  # RSS floored at 0.1 us per point: noiseless data must not pick the bigger model
        return n * math.log(max(float(np.sum(wn * (pred - y) ** 2)) / n, 1e-14)) + k * math.log(n)

    def split(hi):  # compute line below, copy line above; None where the split cannot hold two lines
        # one point to spare on each side (the copy line's over 3 streamed counts): an exact fit
        # of few points would always beat one line
        if len(np.unique(streamed[hi])) < 3 or (~hi).sum() < 5 or not (streamed[hi] > 0).all():
            return None
        lo_coef, lo_rank = _wlstsq(X[~hi], y[~hi], w[~hi])
        (e, f), _ = _wlstsq(X[hi][:, :2], y[hi], w[hi])
        if lo_rank < 4 or f <= max(lo_coef[1], 0.0):  # a copy line is steeper than the compute line's
            return None
        if (_bound(X @ lo_coef, e, f, streamed) <= 0).any():  # a step takes time
            return None
        return lo_coef, (float(e), float(f))

    best = (bic(X @ coef, 4), coef, (0.0, 0.0), X @ coef)
    for t in np.unique(streamed)[:-1] if n >= 10 else []:  # 3 points to spare beyond the 7 parameters
        hi, fit = streamed > t, split(streamed > t)
        for _ in range(20):  # reassign each point to the line that binds there (the switch moves with width)
            if fit is None:
                break
            binds = (fit[1][0] + fit[1][1] * streamed > X @ fit[0]) & (streamed > 0)
            if (binds == hi).all():
                break
            hi, fit = binds, split(binds)
        if fit is not None:
            pred = _bound(X @ fit[0], *fit[1], streamed)
            best = min(best, (bic(pred, 7), fit[0], fit[1], pred), key=lambda c: c[0])
    _, coef, (e, f), pred = best
    # the fewest seconds a streamed page of any median took: under every median, so it only lifts the fit
    # towards them; with no copy line (nothing copy-bound) no floor
    floor = float(np.min(y[streamed > 0] / streamed[streamed > 0])) if f > 0 else 0.0
    return coef, (e, f), floor, _bound(X @ coef, e, f, streamed, floor)


def fit_cost_model(steps: pd.DataFrame, runs: pd.DataFrame | None = None) -> CostModel:
    """Least-squares fit of the target verify time (step_s - draft_s, the draft active) on the median
    of each design point (verify width, streamed pages, pages per layer), each point's squared error
    counted once per step in it, leaving out the steps that still pay a transition
    (``after_transition``: ``eject_s`` counts them), so one-off costs of tens of ms do not drag a
    line fitted to ~2 ms steps. Round statistics: the other rounds with the draft active, as
    measured; acceptance per token (``acceptance_per_token``). ``runs`` (runs.csv) adds the ejects'
    own re-layout time to ``eject_s``."""
    require(steps, STEP_COLUMNS, "steps.csv")
    s = steps[list(STEP_COLUMNS)].assign(plain_measure=in_place(steps)).astype(float).dropna()
    paying = after_transition(steps)
    s = s[~paying.loc[s.index]]
    s = s.assign(target_s=target_seconds(s))
    g = s.groupby(["streamed_pages", "verify_width", "pages_per_layer"])["target_s"].agg(["median", "size"])
    g = g.reset_index()
    coef, copy_line, floor, pred = _fit_lines(g, len(s), s)
    rounds = s[s["draft_active"].astype(bool) & ~in_place(s)]  # the steady rounds with the draft drafting
    if not (rounds["drafted"] > 0).any():
        raise ValueError(f"steps.csv ({len(s)} complete steps) has no round that drafted a token: "
                         f"nothing to predict keeping the draft from")
    resid = pred - g["median"].to_numpy()
    per = {}
    if {"run_id", "context"} <= set(steps.columns):  # each run's prompt length: its first step's context
        prompt = steps["context"].groupby(steps["run_id"]).transform("min").loc[rounds.index]
        by = rounds.groupby(prompt)
        if by.ngroups > 1:
            per = dict(round_contexts=tuple(map(float, by.groups)), round_drafted=tuple(by["drafted"].mean()),
                       round_draft_s=tuple(by["draft_s"].mean()), round_tokens=tuple(1 + by["accepted"].mean()))
    half = round_pages(runs)  # a fixed ring: the page cost per streaming-round count too
    per_rounds = dict(ring_round_pages=half, **page_costs(steps, paying)) if half else {}
    return CostModel(*map(float, coef), acceptance=acceptance_per_token(rounds[rounds["drafted"] > 0]),
                     drafted_per_round=float(rounds["drafted"].mean()),
                     draft_s_per_round=float(rounds["draft_s"].mean()),
                     tokens_per_round=1 + float(rounds["accepted"].mean()), n_steps=len(s),
                     rms_residual_s=float(np.sqrt(np.average(resid ** 2, weights=g["size"]))),
                     eject_s=eject_cost(steps) + (0.0 if runs is None else eject_seconds(runs)),
                     e=copy_line[0], f=copy_line[1], copy_floor=floor, page_s=page_cost(steps, paying),
                     **per, **per_rounds)


def round_pages(runs: pd.DataFrame | None) -> int | None:
    """Streamed pages per round (half a fixed ring) of the study's runs; None: not one fixed ring
    (``cache.ring_pages=auto`` streams in one round), or the runs do not say."""
    if runs is None or "config" not in runs:
        return None
    rings = {str(json.loads(c).get("cache", {}).get("ring_pages")) for c in runs["config"].dropna()}
    return max(1, int(rings.pop()) // 2) if len(rings) == 1 and next(iter(rings)).isdigit() else None
