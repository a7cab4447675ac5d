"""`llmsched calibrate`: measure this machine's CPU and keep it as a named hardware profile file."""

from __future__ import annotations

import argparse
from pathlib import Path

from llmsched.sim.profile_file import compare, read_calibration, write_profile

# Fitted figures of two calibrations of one machine should agree this well.
AGREEMENT = 0.05


def add_calibrate_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register the `calibrate` subcommand on ``sub``."""
    p = sub.add_parser(
        "calibrate",
        help="measure this CPU for the simulator and write a named hardware profile file",
        description="Measure this machine's CPU as the simulator's cost model sees it, in the dtype the "
        "torch executor's auto runs here (bfloat16 with bfloat16 matmuls, else float32): matmul peak, "
        "copy bandwidth, attention and weight-streaming efficiencies, the linears' efficiency by rows and "
        "prefill attention's by prompt length (efficiency curves), then the torch executor's per-step, "
        "per-layer and per-request host costs and decode KV read rate, and write a profile file that "
        "`llmsched simulate --hardware FILE` loads. Every figure is timed until its readings settle and "
        "agree, each in a window checked for other processes' CPU time; a calibration that does not "
        "settle, or that ran beside a busy process, says why and writes nothing (exit status 1) unless "
        "--keep-unsettled. A settled calibration also replaces the cached `cpu` profile.",
    )
    p.add_argument(
        "-o",
        "--output",
        default="cpu-profile.json",
        metavar="FILE.json",
        help="profile file to write (default cpu-profile.json)",
    )
    p.add_argument("--name", default=None, help="the profile's name (default: the file's stem)")
    p.add_argument(
        "--keep-unsettled",
        action="store_true",
        help="write the file even if the calibration did not settle (it stays marked settled: false, "
        "and loading it warns)",
    )
    p.add_argument(
        "--compare",
        action="append",
        metavar="OTHER.json",
        help="print each fitted figure's difference from another profile file "
        f"(more than {100 * AGREEMENT:.0f}%% is flagged)",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="test sizes and no executor probe: seconds, for checking the machinery, not for simulating",
    )
    p.set_defaults(func=run_calibrate)
    return p


def _print_readings(cal: dict) -> None:
    print(f"{'figure':<28}{'value':>14}{'spread':>9}{'calls':>7}{'others':>8}  settled")
    for r in cal.get("readings", []):
        print(
            f"{r['name']:<28}{r['value']:>14.4g}{100 * r['spread']:>8.1f}%{r['calls']:>7}"
            f"{100 * r['foreign_share']:>7.0f}%  {'yes' if r['settled'] else 'NO'}"
        )
    load = cal.get("load", {})
    print(
        f"other processes' share of the cores: before {100 * load.get('before', 0):.0f}%, during "
        f"{100 * load.get('during', 0):.0f}%, after {100 * load.get('after', 0):.0f}%"
    )
    if load.get("busiest_others"):
        print(f"busiest other processes: {'; '.join(load['busiest_others'])}")


def _print_comparison(cal: dict, others: list[str]) -> bool:
    """Each fitted figure against each other file's; True if all agree within AGREEMENT."""
    agree = True
    for other in others:
        print(f"\nagainst {other}:")
        for key, theirs, ours, rel in compare(read_calibration(other), cal):
            flag = "" if abs(rel) <= AGREEMENT else f"  > {100 * AGREEMENT:.0f}%"
            agree = agree and not flag
            print(f"  {key:<24}{theirs:>14.4g}{ours:>14.4g}{100 * rel:>+8.1f}%{flag}")
    return agree


def run_calibrate(args: argparse.Namespace) -> int:
    """Measure (caching a settled result), report, write the profile file unless refused."""
    from llmsched.sim import calibrate

    if args.quick:
        cal = calibrate.measure(quick=True)
    else:
        cal = calibrate.calibration(recalibrate=True)
    _print_readings(cal)
    if args.compare:
        _print_comparison(cal, args.compare)
    if not cal["settled"]:
        print("\nthe calibration did not settle:")
        for problem in cal["problems"]:
            print(f"  - {problem}")
        if not args.keep_unsettled:
            print(f"nothing written to {args.output} (--keep-unsettled writes it anyway, marked unsettled)")
            return 1
    hw = write_profile(Path(args.output), cal, args.name)
    print(f"\n{hw.name}: {hw.description}")
    print(f"wrote {args.output} (took {cal['seconds']:.1f} s; simulate with --hardware {args.output})")
    return 0 if cal["settled"] else 1
