"""A sweep's results: the table of every point, the Pareto front, the cheapest point, a plot."""

from __future__ import annotations

from pathlib import Path

from llmsched.sim.sweep import Sweep, cheapest, pareto_front


def _knobs(rows: list[dict]) -> list[str]:
    """The config keys that vary between points (those that do not are not worth a column)."""
    keys: list[str] = []
    for r in rows:
        for k in r["config"]:
            if k not in keys:
                keys.append(k)
    return [k for k in keys if len({repr(r["config"].get(k)) for r in rows}) > 1] or keys


def format_table(rows: list[dict], sweep: Sweep) -> str:
    """Every point, one line each, then the Pareto front and the cheapest point meeting the SLO."""
    knobs = _knobs(rows)
    front = {r["point"] for r in pareto_front(rows)}
    best = cheapest(rows)
    head = ["#", *knobs, "GPUs", "cost", "tok/s/GPU", "p99 TTFT ms", "mean TPOT ms", "SLO", "front"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [str(r["point"]), *(str(r["config"].get(k, "")) for k in knobs)]
        if "error" in r:
            cells += ["", "", "", "", "", "error: " + r["error"][:60], ""]
        else:
            cells += [
                str(r["gpus"]),
                f"{r['cost']:g}",
                f"{r['throughput_per_gpu']:.1f}",
                f"{r['p99_ttft_ms']:.1f}",
                f"{r['mean_tpot_ms']:.2f}",
                "meets" if r["meets_slo"] else "misses",
                "*" if r["point"] in front else "",
            ]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    lines.append(
        f"Pareto front (throughput per GPU vs p99 TTFT): points {', '.join(str(p) for p in sorted(front))}"
    )
    if best is None:
        lines.append(f"No configuration meets p99 TTFT <= {sweep.slo_p99_ttft_ms:g} ms.")
    else:
        lines.append(
            f"Cheapest meeting p99 TTFT <= {sweep.slo_p99_ttft_ms:g} ms: point {best['point']} "
            f"{best['config']} ({best['gpus']} GPUs, cost {best['cost']:g}, "
            f"{best['throughput_per_gpu']:.1f} tok/s/GPU, p99 TTFT {best['p99_ttft_ms']:.1f} ms)"
        )
    return "\n".join(lines)


def sweep_json(rows: list[dict], sweep: Sweep, wall_s: float, backend: str) -> dict:
    """Every point, the front and the cheapest point, for --result-json."""
    best = cheapest(rows)
    return {
        "slo": {"p99_ttft_ms": sweep.slo_p99_ttft_ms},
        "workload": {k: (v if v != float("inf") else "inf") for k, v in sweep.workload.items()},
        "backend": backend,
        "wall_s": wall_s,
        "points": rows,
        "pareto_front": [r["point"] for r in pareto_front(rows)],
        "cheapest": best["point"] if best is not None else None,
    }


def write_sweep_plot(rows: list[dict], sweep: Sweep, path: str | Path) -> Path:
    """Throughput per GPU against p99 TTFT: every point, the front, the SLO and the cheapest point."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if "error" not in r and r["completed"]]
    front = pareto_front(rows)
    best = cheapest(rows)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.scatter(
        [r["p99_ttft_ms"] for r in ok], [r["throughput_per_gpu"] for r in ok], s=12, alpha=0.5, label="points"
    )
    ax.plot(
        [r["p99_ttft_ms"] for r in front],
        [r["throughput_per_gpu"] for r in front],
        "o-",
        color="C1",
        label="Pareto front",
    )
    ax.axvline(sweep.slo_p99_ttft_ms, color="C3", linestyle="--", label="SLO (p99 TTFT)")
    if best is not None:
        ax.scatter(
            [best["p99_ttft_ms"]],
            [best["throughput_per_gpu"]],
            s=80,
            marker="*",
            color="C2",
            label="cheapest",
        )
    ax.set_xscale("log")
    ax.set_xlabel("p99 TTFT (ms)")
    ax.set_ylabel("output tokens/s per GPU")
    ax.legend()
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
