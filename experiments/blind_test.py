"""Check a committed crossover prediction against a study run after it (a blind test).

    python -m experiments.blind_test results/<predicting study> results/<test study>

The prediction is the predicting study's ``crossover.json`` (``predicted.context_tokens``: the cost
model fitted on that study's steps alone). The measured crossover comes from both studies' runs
together (``crossover.crossover``: linear between the bracketing contexts, bootstrap over reps),
since the test's contexts may lie past the crossover on one side only. It is blind where the test's
rows ran a commit whose tree already held that prediction (checked with git when the commit is
known here). Writes ``blind_test.json`` in the test study's folder: prediction, measurement,
relative error against ``crossover.PREDICTION_GOAL`` (and at the measurement's interval points), the predicting study's cost model's tok/s for
both arms at the test's contexts beside the measured means (where a miss comes from), the config keys the two studies' rows differ
in besides context and rep, and the blindness check.
"""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path

import pandas as pd

from experiments.cost_model import fit_cost_model
from experiments.crossover import PREDICTION_GOAL, _jsonable, crossover, decode_table, describe, predict, read_study

PER_CELL = {"context", "rep", "arm", "study"}  # config keys a study varies by design (arm: its policy)


def flat(config: str, prefix: str = "") -> dict:
    """A row's resolved config (JSON) as {dotted.key: value}."""
    out = {}
    for k, v in (json.loads(config) if isinstance(config, str) else config).items():
        key = f"{prefix}{k}"
        out |= flat(v, key + ".") if isinstance(v, dict) else {key: json.dumps(v)}
    return out


def config_differences(a: pd.DataFrame, b: pd.DataFrame) -> dict:
    """{key: [values in a, values in b]} for the config keys whose values differ between the two
    studies' rows, other than those a study varies per cell (context, rep, arm, study) and the
    policy keys an arm sets."""
    if "config" not in a or "config" not in b:
        return {"unknown": "runs.csv has no config column"}
    arm_keys = lambda k: k.split(".")[0] == "policy"

    def values(runs):
        out: dict[str, set] = {}
        for c in runs["config"].dropna():
            for k, v in flat(c).items():
                if k not in PER_CELL and not arm_keys(k):
                    out.setdefault(k, set()).add(v)
        return out
    va, vb = values(a), values(b)
    return {k: [sorted(va.get(k, ())), sorted(vb.get(k, ()))] for k in sorted(va.keys() | vb.keys())
            if va.get(k) != vb.get(k)}


def committed_before(predicting: Path, commits) -> dict:
    """Whether every commit the test's rows ran holds the predicting study's crossover.json with the
    same predicted context (git, in this checkout); "unknown" where git or a commit is missing."""
    path = (predicting / "crossover.json").as_posix()
    want = json.loads((predicting / "crossover.json").read_text())["predicted"]["context_tokens"]
    out = {}
    for c in sorted(set(commits)):
        try:
            known = subprocess.run(["git", "cat-file", "-e", f"{c}^{{commit}}"], capture_output=True, timeout=30)
            r = subprocess.run(["git", "show", f"{c}:{path}"], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.SubprocessError):
            out[c] = "unknown (no git)"
            continue
        if known.returncode != 0:
            out[c] = "unknown (the commit is not in this checkout)"
        elif r.returncode != 0:
            out[c] = "no: not in its tree"
        else:
            got = json.loads(r.stdout)["predicted"]["context_tokens"]
            out[c] = "yes" if got == want else f"no: its tree predicted {got}"
    return out


def arms_at_test(a: pd.DataFrame, steps_a: pd.DataFrame, b: pd.DataFrame, keep: str, eject: str) -> pd.DataFrame:
    """Per test context: keep and eject tok/s as the cost model fitted on the predicting study's steps
    predicts them (its capacities, its decode length) and as the test measured them (means over reps)."""
    table, _ = predict(a, fit_cost_model(steps_a, a), eject, sorted(b["context"].unique()))
    means = decode_table(b).pivot(index="context", columns="arm", values="mean")
    out = pd.DataFrame({"context": table["context"].astype(int), "keep_predicted": table["keep_tok_s"].to_numpy(),
                        "keep_measured": means[keep].reindex(table["context"]).to_numpy(),
                        "eject_predicted": table["eject_tok_s"].to_numpy(),
                        "eject_measured": means[eject].reindex(table["context"]).to_numpy()})
    for arm in ("keep", "eject"):
        out[f"{arm}_predicted_over_measured"] = out[f"{arm}_predicted"] / out[f"{arm}_measured"]
    return out


def blind_test(predicting: Path, test: Path, keep: str = "keep", eject: str = "onset", n_boot: int = 1000,
               seed: int = 0) -> dict:
    prediction = json.loads((predicting / "crossover.json").read_text())["predicted"]
    p = prediction.get("context_tokens")
    if p is None:
        raise ValueError(f"{predicting}/crossover.json predicts no crossover ({prediction.get('reason')})")
    (a, steps_a), (b, _) = read_study(predicting), read_study(test)
    if steps_a is None:
        raise ValueError(f"{predicting} has no steps: its cost model cannot be refitted")
    measured = crossover(pd.concat([a, b], ignore_index=True), keep, eject, n_boot, seed)
    m = measured["context_tokens"]
    error = None if m is None else abs(p - m) / m
    ci = [None if x is None else abs(p - x) / x for x in measured.get("ci_tokens") or []]
    commits = b["git_commit"].dropna().astype(str) if "git_commit" in b else []
    return dict(predicting=str(predicting), test=str(test), predicted=prediction, measured=measured,
                relative_error=error, relative_error_at_ci=ci, goal=f"relative error <= {PREDICTION_GOAL}",
                within_goal=None if error is None else error <= PREDICTION_GOAL,
                arms_at_test_contexts=arms_at_test(a, steps_a, b, keep, eject).to_dict("records"),
                config_differences=config_differences(a, b), prediction_in_tree=committed_before(predicting, commits))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("predicting", type=Path, help="results/<study> whose crossover.json holds the prediction")
    ap.add_argument("test", type=Path, help="results/<study> run after it (runs.csv)")
    ap.add_argument("--keep", default="keep")
    ap.add_argument("--eject", default="onset")
    ap.add_argument("--n-boot", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    try:
        result = _jsonable(blind_test(args.predicting, args.test, args.keep, args.eject, args.n_boot, args.seed))
    except (FileNotFoundError, ValueError, KeyError) as e:
        raise SystemExit(f"blind_test: {e}") from None
    (args.test / "blind_test.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"predicted ({args.predicting}): {describe(result['predicted'])}")
    print(f"measured ({args.predicting} + {args.test}): {describe(result['measured'])}")
    if result["relative_error"] is not None:
        print(f"relative error {result['relative_error']:.1%} (goal <= {PREDICTION_GOAL:.0%}): "
              f"{'within' if result['within_goal'] else 'outside'} the goal; at the measurement's 5/50/95% points: "
              + " / ".join("-" if e is None else f"{e:.1%}" for e in result["relative_error_at_ci"]))
    arms = pd.DataFrame(result["arms_at_test_contexts"])
    print(f"tok/s at the test's contexts, predicted by {args.predicting}'s cost model and measured\n"
          f"{arms.to_string(index=False, float_format='%.3f')}")
    print(f"config differences besides context / rep / arm: {result['config_differences']}")
    print(f"prediction in the test's tree: {result['prediction_in_tree']}")
    print(f"wrote {args.test / 'blind_test.json'}")


if __name__ == "__main__":
    main()
