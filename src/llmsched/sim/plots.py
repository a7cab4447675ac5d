"""PNG figures of a simulation: queues and KV usage over time, tokens per step, latency CDFs.

Uses matplotlib's object API with the Agg canvas, so it never touches a
display or pyplot's global state.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from llmsched.core.errors import ConfigError
from llmsched.sim.runner import SimResult

if TYPE_CHECKING:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

# Series longer than this are averaged into this many bins before plotting.
_MAX_POINTS = 4000
_TOKEN_BINS = 400


def _binned(xs: Sequence[float], ys: Sequence[float], max_points: int = _MAX_POINTS) -> tuple[list, list]:
    """Average consecutive points so at most ``max_points`` remain."""
    n = len(xs)
    if n <= max_points:
        return list(xs), list(ys)
    k = -(-n // max_points)
    bx, by = [], []
    for i in range(0, n, k):
        j = min(i + k, n)
        bx.append(xs[i])
        by.append(sum(ys[i:j]) / (j - i))
    return bx, by


def _cdf(values: Sequence[float]) -> tuple[list[float], list[float]]:
    s = sorted(values)
    n = len(s)
    if n > _MAX_POINTS:
        idx = [round(i * (n - 1) / (_MAX_POINTS - 1)) for i in range(_MAX_POINTS)]
        return [s[i] for i in idx], [(i + 1) / n for i in idx]
    return s, [(i + 1) / n for i in range(n)]


def _weighted_cdf(pairs: Sequence[tuple[float, int]]) -> tuple[list[float], list[float]]:
    total = sum(c for _, c in pairs)
    xs, ys, cum = [], [], 0
    for v, c in pairs:
        cum += c
        xs.append(v)
        ys.append(cum / total)
    return xs, ys


def write_plots(result: SimResult, prefix: str | Path) -> list[Path]:
    """Write PREFIX_timeline.png, PREFIX_tokens.png and PREFIX_latency_cdf.png; returns the paths."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:
        raise ConfigError("--plot needs matplotlib: pip install 'llmsched[sim]'") from e
    series = result.series
    if series is None:
        raise ConfigError("plots need the step series: run simulate(..., record_series=True)")
    prefix = Path(prefix)
    if prefix.parent and not prefix.parent.exists():
        prefix.parent.mkdir(parents=True, exist_ok=True)
    title = result.deployment.cost_model.describe().split(";")[0] if result.deployment else "simulation"
    paths = []

    fig = Figure(figsize=(10, 7), constrained_layout=True)
    ax1, ax2 = fig.subplots(2, 1, sharex=True)
    t = series.time
    x, y = _binned(t, series.num_running)
    ax1.plot(x, y, label="running", color="tab:blue")
    x, y = _binned(t, series.num_waiting)
    ax1.plot(x, y, label="waiting", color="tab:orange")
    ax1.set_ylabel("requests")
    ax1.legend(loc="upper right")
    ax1.set_title(f"{title}: queues and KV cache over simulated time")
    x, y = _binned(t, [100.0 * u for u in series.kv_usage])
    ax2.plot(x, y, color="tab:green")
    ax2.set_ylabel("KV cache used (%)")
    ax2.set_ylim(0, 100)
    ax2.set_xlabel("simulated time (s)")
    paths.append(_save(fig, FigureCanvasAgg, prefix, "timeline"))

    fig = Figure(figsize=(10, 4.5), constrained_layout=True)
    ax = fig.subplots()
    steps = range(len(series))
    # Prefill chunks come in spikes a few steps wide; averaging over bins
    # shows the mix, which single steps at this width would hide.
    x, pre = _binned(steps, series.prefill_tokens, _TOKEN_BINS)
    _, dec = _binned(steps, series.decode_tokens, _TOKEN_BINS)
    ax.stackplot(x, pre, dec, labels=["prefill tokens", "decode tokens"], colors=["tab:red", "tab:blue"])
    ax.set_xlabel("engine step" + (" (mean over bins of steps)" if len(series) > _TOKEN_BINS else ""))
    ax.set_ylabel("tokens per step")
    ax.set_title(f"{title}: tokens per step")
    ax.legend(loc="upper right")
    paths.append(_save(fig, FigureCanvasAgg, prefix, "tokens"))

    fig = Figure(figsize=(10, 7), constrained_layout=True)
    axes = fig.subplots(2, 2)
    m = result.metrics
    panels = [
        ("TTFT", _cdf(list(m.ttfts))),
        ("TPOT", _cdf(m.tpots())),
        ("ITL", _weighted_cdf(m.itl_histogram())),
        ("E2E latency", _cdf(list(m.e2els))),
    ]
    for ax, (name, (xs, ys)) in zip([a for row in axes for a in row], panels):
        ax.plot([v * 1000.0 for v in xs], ys, drawstyle="steps-post")
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("fraction of requests" if name != "ITL" else "fraction of tokens")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
    fig.suptitle(f"{title}: latency CDFs")
    paths.append(_save(fig, FigureCanvasAgg, prefix, "latency_cdf"))
    return paths


def _save(fig: Figure, canvas_cls: type[FigureCanvasAgg], prefix: Path, name: str) -> Path:
    path = prefix.with_name(f"{prefix.name}_{name}.png")
    canvas_cls(fig).print_png(str(path))
    return path
