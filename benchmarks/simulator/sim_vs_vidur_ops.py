"""Per-op fidelity of the GPU cost model against Vidur's measured operator medians.

For every row of the compact copy (benchmarks/data/vidur/, or ``--vidur-dir``
for Vidur's full data) this prices the op on the plain roofline (before any
fit) and with the built-in kernel fit, and, as the evidence, with a fit that
never saw the row's model shape (leave-one-shape-out; A100 attention, which
holds one head shape, leaves out one context band at a time). Prints median
and p90 absolute errors by GPU, op kind and TP degree, and writes JSON.

    PYTHONPATH=src python benchmarks/simulator/sim_vs_vidur_ops.py [--out sim_vs_vidur_ops.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "_common"))
from hostcpu import record_cpu

from llmsched.executor.sim.cost_model import Efficiency
from llmsched.executor.sim.hardware import BUILTIN_HARDWARE
from llmsched.executor.sim.kernel_fit import KernelFit
from llmsched.sim.calibrate_vidur import leave_one_band_out, leave_one_shape_out, rows_for
from llmsched.sim.vidur_data import GEMM_OPS, AttnRow, read_compact, read_vidur_dir
from llmsched.sim.vidur_pricing import fitted_seconds, roofline_seconds

DATA = Path(__file__).resolve().parents[1] / "data" / "vidur"


def _stats(errs: list[float]) -> dict:
    if not errs:
        return {"n": 0}
    s = sorted(errs)
    return {"n": len(s), "median": statistics.median(s), "p90": s[min(len(s) - 1, int(0.9 * len(s)))]}


def _group(gpu: str, kind: str, tp, sel: list, hw, fit: KernelFit, loo: dict) -> dict:
    """Before / fitted / left-out error statistics of one group of rows."""

    def errs(price) -> list[float]:
        return [abs(price(r) / (r.median_ms * 1e-3) - 1) for r in sel]

    return {
        "gpu": gpu,
        "kind": kind,
        "tp": tp,
        "before": _stats(errs(lambda r: roofline_seconds(r, hw, Efficiency()))),
        "fitted": _stats(errs(lambda r: fitted_seconds(r, hw, fit))),
        "left_out": _stats(errs(lambda r: loo[r])),
    }


def kind_of(r) -> str:
    """The report's op kind of a row."""
    if isinstance(r, AttnRow):
        return "attn_prefill" if r.prefill else "attn_decode"
    return "gemm" if r.op in GEMM_OPS else "elementwise"


def report(data) -> dict:
    """Before / built-in fit / left-out errors per GPU, kind and TP."""
    out: dict = {"groups": []}
    for gpu in ("a100", "h100"):
        hw = BUILTIN_HARDWARE[gpu]
        fit = KernelFit.from_dict(hw.kernel_fit)
        ops, attn, _ = rows_for(data, gpu)
        loo = dict(leave_one_shape_out(ops, hw))
        loo.update(leave_one_band_out(attn, hw) if attn else [])
        for kind in ("gemm", "elementwise", "mlp_side", "attn_prefill", "attn_decode"):
            rows = ops if kind == "mlp_side" else [r for r in ops + attn if kind_of(r) == kind]
            for tp in [*sorted({getattr(r, "tp", 0) for r in rows}), "all"]:
                sel = [r for r in rows if tp == "all" or r.tp == tp]
                if not sel:
                    continue

                out["groups"].append(_group(gpu, kind, tp, sel, hw, fit, loo))
    # The two H100 profiles of the same shapes, and what each says against the other.
    h = {}
    for r in data.ops:
        if r.gpu == "h100" and r.op in GEMM_OPS:
            h.setdefault((r.shape, r.op, r.tp, r.tokens), {})[r.version] = r.median_ms
    ratios = [v["acb95f6"] / v["7d47513"] for v in h.values() if len(v) == 2]
    out["h100_acb95f6_over_7d47513_gemm_median"] = statistics.median(ratios) if ratios else None
    return out


def main(argv: list[str] | None = None) -> int:
    """Print the table, write JSON."""
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--vidur-dir", help="Vidur's full profiling data (default: the compact copy)")
    ap.add_argument("--out", default="sim_vs_vidur_ops.json")
    args = ap.parse_args(argv)
    data = read_vidur_dir(args.vidur_dir) if args.vidur_dir else read_compact(DATA)
    res = report(data)
    head = ("before med/p90", "fitted med/p90", "left-out med/p90")
    print(f"{'gpu':5} {'kind':13} {'tp':>3} | {head[0]:>15} | {head[1]:>15} | {head[2]:>17} | n")
    for g in res["groups"]:
        cells = [f"{g[k]['median']:6.1%} /{g[k]['p90']:6.1%}" for k in ("before", "fitted", "left_out")]
        row = f"{g['gpu']:5} {g['kind']:13} {g['tp']!s:>3} | {cells[0]:>15} | {cells[1]:>15}"
        print(f"{row} | {cells[2]:>17} | {g['fitted']['n']}")
    ratio = res["h100_acb95f6_over_7d47513_gemm_median"]
    print(f"H100 GEMMs, Vidur acb95f6 / 7d47513 median time ratio: {ratio:.2f}")
    record_cpu(res)
    Path(args.out).write_text(json.dumps(res, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
