"""serve_vs_vllm's defaults make the equal-cores comparison and its plot draws only measured curves."""

from __future__ import annotations

import math
import os

import serve_vs_vllm


def _rec(rate: float, ms: float) -> dict:
    return {"rate": rate, **dict.fromkeys(serve_vs_vllm.SUMMARY_KEYS, ms)}


def test_defaults_bind_vllm_to_every_usable_core_and_run_four_poisson_loads():
    args = serve_vs_vllm.parse_args(["--model", "m"])
    cores = sorted(os.sched_getaffinity(0))
    first, _, last = args.vllm_omp_bind.partition("-")
    assert int(first) == cores[0] and int(last or first) == cores[-1]
    loads = serve_vs_vllm.poisson_loads(args, capacity=2.0)
    assert [round(r, 6) for _, r in loads] == [0.6, 1.2, 1.8, 2.2]


def test_the_burst_is_a_marker_of_its_own(tmp_path, monkeypatch):
    import matplotlib.axes

    lines: list[list[float]] = []
    real_plot = matplotlib.axes.Axes.plot

    def spy(self, xs, *rest, **kw):
        lines.append(list(xs))
        return real_plot(self, xs, *rest, **kw)

    monkeypatch.setattr(matplotlib.axes.Axes, "plot", spy)
    fracs = {"30%": 0.3, "60%": 0.6, "90%": 0.9, "110%": 1.1}
    summary = {"a": {"burst": _rec(math.inf, 9.0), **{k: _rec(r, r * 10) for k, r in fracs.items()}}}
    serve_vs_vllm.plot(summary, tmp_path / "p.png", "t")
    assert (tmp_path / "p.png").stat().st_size > 0
    curves = [xs for xs in lines if len(xs) > 1]
    # Per metric: a median and a p99 curve over the four rates, and the burst's two lone markers.
    assert len(curves) == 6 and all(xs == [0.3, 0.6, 0.9, 1.1] for xs in curves)
    assert sum(len(xs) == 1 for xs in lines) == 6
