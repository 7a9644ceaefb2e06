"""Check a committed crossover prediction against a study run after it (a blind test).

    python -m experiments.blind_test results/<predicting study> results/<test study> [--prediction FILE]

The prediction is the one the predicting study's ``crossover.json`` (or ``FILE``: experiments/what_if.py's
``what_if_<mib>.json``, a prediction for another arena) held in the tree of the commit the test's rows
ran (git): blind, since it was committed before they ran. Where git cannot say, the
folder's present crossover.json stands in, marked not blind; a later refit's prediction (the
folder's crossover.json now, where it differs) is reported beside as what it is: post hoc. The
measured crossover comes from both studies' runs together (``crossover.crossover``: linear between
the bracketing contexts, bootstrap over reps), since the test's contexts may lie on one side of it;
for another arena from the test's runs alone.
Writes ``blind_test.json`` in the test study's folder: prediction, measurement, relative error against
``crossover.PREDICTION_GOAL`` (and at the measurement's interval points), the present cost model
fitted on the predicting study's steps: its tok/s for both arms at the test's contexts beside the
measured means (where a miss comes from), and the config keys the two studies' rows differ in
besides context, rep and arm.
"""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path

import pandas as pd

from experiments.cost_model import fit_cost_model
from experiments.crossover import (PAGE, PREDICTION_GOAL, _jsonable, add_arm_args, crossover, decode_table, describe,
                                   predict, read_study)
from experiments.what_if import capacities

PER_CELL = {"context", "rep", "arm", "study", "policy"}  # what a study varies by design (an arm sets its policy)


def flat(config: str, prefix: str = "") -> dict:
    """A row's resolved config (JSON) as {dotted.key: value}."""
    out = {}
    for k, v in (json.loads(config) if isinstance(config, str) else config).items():
        key = f"{prefix}{k}"
        out |= flat(v, key + ".") if isinstance(v, dict) else {key: json.dumps(v)}
    return out


def config_differences(a: pd.DataFrame, b: pd.DataFrame) -> dict:
    """{key: [values in a, values in b]} for the config keys whose values differ between the two
    studies' rows, other than those under ``PER_CELL``."""
    if "config" not in a or "config" not in b:
        return {"unknown": "runs.csv has no config column"}

    def values(runs):
        out: dict[str, set] = {}
        for c in runs["config"].dropna():
            for k, v in flat(c).items():
                if k.split(".")[0] not in PER_CELL:
                    out.setdefault(k, set()).add(v)
        return out
    va, vb = values(a), values(b)
    return {k: [sorted(va.get(k, ())), sorted(vb.get(k, ()))] for k in sorted(va.keys() | vb.keys())
            if va.get(k) != vb.get(k)}


def _in_repo(path: Path) -> str:
    """``path`` as git names it in a tree: relative to the repository's top (as given where git cannot say)."""
    try:
        top = subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True, text=True, timeout=30)
        return Path(path).resolve().relative_to(Path(top.stdout.strip()).resolve()).as_posix()
    except (OSError, subprocess.SubprocessError, ValueError):
        return Path(path).as_posix()


def prediction_in_tree(prediction: Path, commit: str):
    """The crossover (tokens) the prediction file (a crossover.json, or what_if's what_if_<mib>.json)
    predicted in ``commit``'s tree, or a string saying why there is none: "not in its tree", or
    "unknown ..." where git or the commit is missing here."""
    try:
        known = subprocess.run(["git", "cat-file", "-e", f"{commit}^{{commit}}"], capture_output=True, timeout=30)
        r = subprocess.run(["git", "show", f"{commit}:{_in_repo(prediction)}"], capture_output=True, text=True,
                           timeout=30)
    except (OSError, subprocess.SubprocessError):
        return "unknown (no git)"
    if known.returncode != 0:
        return "unknown (the commit is not in this checkout)"
    if r.returncode != 0:
        return "not in its tree"
    return json.loads(r.stdout)["predicted"]["context_tokens"]


def blind_prediction(prediction: Path, commits) -> tuple[float | None, dict]:
    """The prediction every commit the test's rows ran held (None where they held none, or not one
    value), and per commit what its tree held."""
    held = {c: prediction_in_tree(prediction, c) for c in sorted(set(commits))}
    values = set(held.values())
    one = values.pop() if len(values) == 1 else None
    return (None if isinstance(one, str) else one), held


def arms_at_test(a: pd.DataFrame, steps_a: pd.DataFrame, b: pd.DataFrame, keep: str, eject: str,
                 arena_mib: float | None = None) -> pd.DataFrame:
    """Per test context: keep and eject tok/s as the cost model fitted on the predicting study's steps
    predicts them (its capacities, or with ``arena_mib`` what_if's capacities in that arena; its decode
    length) and as the test measured them (means over reps)."""
    caps = None if arena_mib is None else capacities(a, steps_a, arena_mib)
    table, _ = predict(a, fit_cost_model(steps_a, a), eject, sorted(b["context"].unique()), caps=caps)
    means = decode_table(b).pivot(index="context", columns="arm", values="mean")
    out = pd.DataFrame({"context": table["context"].astype(int), "keep_predicted": table["keep_tok_s"].to_numpy(),
                        "keep_measured": means[keep].reindex(table["context"]).to_numpy(),
                        "eject_predicted": table["eject_tok_s"].to_numpy(),
                        "eject_measured": means[eject].reindex(table["context"]).to_numpy()})
    for arm in ("keep", "eject"):
        out[f"{arm}_predicted_over_measured"] = out[f"{arm}_predicted"] / out[f"{arm}_measured"]
    return out


def blind_test(predicting: Path, test: Path, keep: str = "keep", eject: str = "onset", n_boot: int = 1000,
               seed: int = 0, prediction: Path | None = None) -> dict:
    """``prediction``: the file holding it (default the predicting study's crossover.json; a what_if
    file predicts another arena, so the crossover is measured on the test's runs alone)."""
    (a, steps_a), (b, _) = read_study(predicting), read_study(test)
    if steps_a is None:
        raise ValueError(f"{predicting} has no steps: its cost model cannot be refitted")
    prediction = Path(prediction) if prediction else Path(predicting) / "crossover.json"
    commits = b["git_commit"].dropna().astype(str) if "git_commit" in b else []
    blind, held = blind_prediction(prediction, commits)
    now = json.loads(prediction.read_text())
    current, arena = now["predicted"].get("context_tokens"), now.get("arena_mib")
    if blind is None and current is None:
        raise ValueError(f"{prediction} predicts no crossover, and the test's commits held none: {held}")
    # the same setup: both studies' contexts locate the crossover; another arena: the test's alone
    measured = crossover(b if arena is not None else pd.concat([a, b], ignore_index=True), keep, eject, n_boot, seed)
    m = measured["context_tokens"]

    def errors(p):  # relative error at the measurement and at its interval's points
        return (None if m is None or p is None else abs(p - m) / m,
                [None if x is None or p is None else abs(p - x) / x for x in measured.get("ci_tokens") or []])
    p = blind if blind is not None else current
    error, at_ci = errors(p)
    post_hoc = errors(current)[0]
    return dict(predicting=str(predicting), test=str(test), prediction_file=str(prediction), arena_mib=arena,
                measured=measured,
                predicted=dict(context_tokens=p, pages_per_layer=None if p is None else p / PAGE,
                               blind=blind is not None, held_by_the_tests_commits=held),
                relative_error=error, relative_error_at_ci=at_ci, goal=f"relative error <= {PREDICTION_GOAL}",
                within_goal=None if error is None else error <= PREDICTION_GOAL,
                current_prediction=dict(context_tokens=current, relative_error=post_hoc,
                                        note="the prediction file now (a later refit: not blind)"),
                arms_at_test_contexts=arms_at_test(a, steps_a, b, keep, eject, arena).to_dict("records"),
                config_differences=config_differences(a, b))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("predicting", type=Path, help="results/<study> whose crossover.json holds the prediction")
    ap.add_argument("test", type=Path, help="results/<study> run after it (runs.csv)")
    ap.add_argument("--prediction", type=Path, help="the file holding the prediction (default: the predicting "
                    "study's crossover.json; experiments/what_if.py --out writes one per arena)")
    add_arm_args(ap)
    args = ap.parse_args(argv)
    try:
        result = _jsonable(blind_test(args.predicting, args.test, args.keep, args.eject, args.n_boot, args.seed,
                                      args.prediction))
    except (FileNotFoundError, ValueError, KeyError) as e:
        raise SystemExit(f"blind_test: {e}") from None
    (args.test / "blind_test.json").write_text(json.dumps(result, indent=2) + "\n")
    p = result["predicted"]
    print(f"predicted ({args.predicting}, {'blind: held by the test commits' if p['blind'] else 'NOT blind'}"
          f" {p['held_by_the_tests_commits']}): {describe(p)}")
    over = args.test if result["arena_mib"] is not None else f"{args.predicting} + {args.test}"
    print(f"measured ({over}): {describe(result['measured'])}")
    if result["relative_error"] is not None:
        print(f"relative error {result['relative_error']:.1%} (goal <= {PREDICTION_GOAL:.0%}): "
              f"{'within' if result['within_goal'] else 'outside'} the goal; at the measurement's 5/50/95% points: "
              + " / ".join("-" if e is None else f"{e:.1%}" for e in result["relative_error_at_ci"]))
    now = result["current_prediction"]
    if now["context_tokens"] != p["context_tokens"] and now["relative_error"] is not None:
        print(f"the folder's prediction now: {now['context_tokens']:.0f} tokens, {now['relative_error']:.1%} off "
              f"(a later refit: not blind)")
    arms = pd.DataFrame(result["arms_at_test_contexts"])
    print(f"tok/s at the test's contexts, predicted by {args.predicting}'s cost model and measured\n"
          f"{arms.to_string(index=False, float_format='%.3f')}")
    print(f"config differences besides context / rep / arm: {result['config_differences']}")
    print(f"wrote {args.test / 'blind_test.json'}")


if __name__ == "__main__":
    main()
