#!/usr/bin/env python3
"""How far the real side of sim_vs_real moves between runs: the noise floor under every prediction error.

Reads several ``benchmarks/simulator/sim_vs_real.py`` result files (the same
scenarios, run one after another) and, for every target figure, prints the
spread of what the torch executor measured across all their real runs
(each file holds several per scenario): min, median, max and max/min.
Two verdicts follow:

- figures whose real values spread more than (1 + e) / (1 - e), e the
  target error the results record (1.222 for sim_vs_real's 10%): no
  prediction, however good, is within e of every run;
- the median oracle: a predictor that knew each figure's median over all
  these runs (in hindsight, so better than any simulator can be), judged
  in each file as sim_vs_real judges the simulator. For each file it says
  in how many scenarios that oracle holds, beside how many the simulator
  held, and the longest streak of consecutive files in which the oracle
  holds in all of them.

The rule (``judge``, which sim_vs_real.py uses too): a predicted figure
holds when it lies inside its real runs' [min, max] or within e of their
median; a scenario holds when all its figures do. With one real run (older
result files) that is the earlier rule, within e of that run.

When the oracle itself cannot hold run after run, the misses of the
simulator on that machine are the machine's, not the model's.

    python benchmarks/simulator/sim_vs_real_spread.py results/run1.json results/run2.json ... [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "_common"))
from hostcpu import record_cpu


@dataclass(frozen=True, slots=True)
class Holding:
    """A prediction judged against the real runs of one figure."""

    median: float
    low: float
    high: float
    # Prediction / median - 1 (nan when the median is 0).
    error: float
    in_range: bool
    near_median: bool

    @property
    def holds(self) -> bool:
        """Inside the real runs' range, or within the target of their median."""
        return self.in_range or self.near_median

    @property
    def spread(self) -> float:
        """max / min of the real runs (inf when the smallest is 0)."""
        return self.high / self.low if self.low > 0 else math.inf

    def why(self, target: float) -> str:
        """Why it holds, or by how much it misses, in a few words."""
        if self.in_range:
            return "in range"
        if self.near_median:
            return f"within {100 * target:.0f}%"
        return "misses"


def judge(real: list[float], predicted: float, target: float) -> Holding:
    """Whether a predicted figure holds against several real runs of it.

    A machine whose real runs move between runs cannot be predicted to
    within ``target`` of each run; a prediction holds when it lies inside
    the runs' [min, max] or within ``target`` of their median.
    """
    if not real:
        raise ValueError("judge needs at least one real run")
    if not 0 < target < 1:
        raise ValueError(f"target error {target!r} must be in (0, 1)")
    med = statistics.median(real)
    lo, hi = min(real), max(real)
    error = predicted / med - 1.0 if med else math.nan
    # The band as bounds, so that its ends count despite rounding; a zero
    # median has no band, only the range.
    near = med > 0 and med * (1 - target) <= predicted <= med * (1 + target)
    return Holding(med, lo, hi, error, lo <= predicted <= hi, near)


def reachable_spread(target: float) -> float:
    """The largest max/min of a figure's runs for which one value is within ``target`` of both ends."""
    return (1 + target) / (1 - target)


def load_runs(paths: list[str]) -> tuple[list[dict], float]:
    """The result files, in the order given (their run order), and the target error they share.

    Each must be a sim_vs_real result; the target is the one each result
    records (``target_error``), so it is never restated here.
    """
    runs = []
    for p in paths:
        data = json.loads(Path(p).read_text())
        if data.get("benchmark") != "sim_vs_real":
            raise SystemExit(f"{p}: not a sim_vs_real result (benchmark={data.get('benchmark')!r})")
        runs.append(data)
    targets = {run["target_error"] for run in runs}
    if len(targets) != 1:
        raise SystemExit(f"the results were judged against different target errors: {sorted(targets)}")
    return runs, targets.pop()


def real_values(fig: dict) -> list[float]:
    """A figure's real runs in one result file (one, ``measured``, in files from before several were kept)."""
    return list(fig["runs"]) if "runs" in fig else [fig["measured"]]


def measured(runs: list[dict]) -> dict[tuple[str, str], list[float]]:
    """(scenario, figure) -> the real values of every real run in every file that has the scenario."""
    out: dict[tuple[str, str], list[float]] = {}
    for run in runs:
        for sc in run["scenarios"]:
            for key, fig in sc["figures"].items():
                out.setdefault((sc["scenario"], key), []).extend(real_values(fig))
    return out


def oracle_passes(runs: list[dict], medians: dict[tuple[str, str], float], target: float) -> list[list[str]]:
    """Per file, the scenarios in which predicting every figure's overall median holds against its runs."""
    out = []
    for run in runs:
        ok = []
        for sc in run["scenarios"]:
            name = sc["scenario"]
            if all(judge(real_values(f), medians[(name, k)], target).holds for k, f in sc["figures"].items()):
                ok.append(name)
        out.append(ok)
    return out


def longest_streak(flags: list[bool]) -> int:
    """The longest run of consecutive True."""
    best = cur = 0
    for f in flags:
        cur = cur + 1 if f else 0
        best = max(best, cur)
    return best


def spread_table(values: dict[tuple[str, str], list[float]], medians: dict, target: float) -> list[dict]:
    """Print each figure's real min, median and max across the runs; the rows as dicts."""
    limit = reachable_spread(target)
    rows = []
    print(f"{'scenario':<14}{'figure':<20}{'runs':>5}{'min':>11}{'median':>11}{'max':>11}{'max/min':>9}")
    for (scenario, figure), xs in values.items():
        lo, hi, med = min(xs), max(xs), medians[(scenario, figure)]
        spread = hi / lo if lo > 0 else float("inf")
        reachable = spread <= limit
        rows.append(
            {
                "scenario": scenario,
                "figure": figure,
                "runs": len(xs),
                "min": lo,
                "median": med,
                "max": hi,
                "max_over_min": spread,
                "reachable": reachable,
            }
        )
        mark = "" if reachable else f"  no prediction within {100 * target:.0f}% of every run"
        print(f"{scenario:<14}{figure:<20}{len(xs):>5}{lo:>11.2f}{med:>11.2f}{hi:>11.2f}{spread:>9.2f}{mark}")
    return rows


def simulator_held(run: dict) -> str:
    """How many scenarios the simulator held in one result file, as it recorded."""
    n = len(run["scenarios"])
    if "criterion" not in run:
        return f"{len(run['scenarios_within_target'])}/{n} (within the target of its one counted run)"
    return f"{len(run['scenarios_within_target'])}/{n}"


def main(argv: list[str] | None = None) -> int:
    """Print the spread and the oracle's verdict; write them as JSON with --json."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("results", nargs="+", help="sim_vs_real.py result files, in run order")
    ap.add_argument("--json", help="also write the figures here")
    args = ap.parse_args(argv)
    if len(args.results) < 2:
        ap.error("give at least two result files: a spread needs runs to compare")
    runs, target = load_runs(args.results)
    values = measured(runs)
    medians = {key: statistics.median(xs) for key, xs in values.items()}
    rows = spread_table(values, medians, target)
    unreachable = [r for r in rows if not r["reachable"]]
    passes = oracle_passes(runs, medians, target)
    total = [len(run["scenarios"]) for run in runs]
    streak = longest_streak([len(p) == n for p, n in zip(passes, total)])
    print(
        f"\n{len(unreachable)} of {len(rows)} figures spread beyond {reachable_spread(target):.3f} "
        f"(max/min) over the real runs of {len(runs)} result files "
        f"({max(r['runs'] for r in rows)} runs at most)"
    )
    print(
        "scenarios that hold (every figure in its runs' range or within the target of their median), "
        "for the median oracle (each figure's median over all these runs, in hindsight) and the simulator:"
    )
    for path, p, run in zip(args.results, passes, runs):
        print(f"  {path}: oracle {len(p)}/{len(run['scenarios'])}, simulator {simulator_held(run)}")
    print(f"longest streak of files in which the oracle holds in every scenario: {streak}")
    if args.json:
        out = {
            "benchmark": "sim_vs_real_spread",
            "results": args.results,
            "target_error": target,
            "figures": rows,
            "oracle_scenarios_met": [len(p) for p in passes],
            "oracle_longest_streak": streak,
            "simulator_scenarios_held": [len(run["scenarios_within_target"]) for run in runs],
        }
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(record_cpu(out), indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
