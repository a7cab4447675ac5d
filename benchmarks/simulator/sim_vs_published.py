"""The simulator against published vLLM serving runs (benchmarks/published/*.json).

Each corpus file is one source page: where it is (URL, repository, path,
commit), the deployment it served (model, GPU, TP, vLLM version, serve
command and the engine settings assumed where the page is silent), what the
page leaves unknown and how it is set here, and its points (the bench
command, the workload and the figures reported). Every point is simulated
with ``llmsched simulate`` configured as the source's vLLM was, on the
built-in a100/h100 profiles, and compared figure by figure: throughput
(output tok/s, or request/s where that is all the page gives), median TPOT
and median TTFT. Nothing is fitted to these points: they are evidence.

The API servers are modelled as each source's `vllm serve` ran them (its
``api_server_count``, vLLM's default 1): requests reach the engine through
them and every output token is streamed back through them, one serial
queue per server, at the CPU costs measured for vLLM's own API server
(``llmsched.sim.frontend``; the chat endpoint's per-request cost for points
benchmarked through /v1/chat/completions). ``--no-frontend`` simulates the
engine alone (every request reaches it when sent), as before. Each row says
how busy the simulated API server was (its work over the run's duration):
near 100% the frontend sets the pace, well below it the engine does.

``--h100-ops acb95f6`` also simulates the H100 points on an H100 profile
whose kernel fit is redone from Vidur's earlier H100 operator profile
(acb95f6) instead of the re-profile (7d47513) the built-in ``h100`` trusts:
fitted to operator rows only, the same way, as a diagnosis of which
measurements the published runs side with.

    PYTHONPATH=src python benchmarks/simulator/sim_vs_published.py [--only ID] [--h100-ops acb95f6]
        [--no-frontend] [--json PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "_common"))
from hostcpu import record_cpu

from llmsched.cli import main as llmsched_main
from llmsched.sim.frontend import CHAT_REQUEST_S, DEFAULT_REQUEST_S

CORPUS = Path(__file__).resolve().parents[1] / "published"
VIDUR = Path(__file__).resolve().parents[1] / "data" / "vidur"
SOURCE_FIELDS = ("title", "url", "repository", "path", "commit", "section")
DEPLOYMENT_FIELDS = (
    "model", "sim_model", "gpu", "sim_hardware", "gpu_count", "tensor_parallel_size",
    "vllm_version", "serve_command", "api_server_count", "engine",
)  # fmt: skip
ENGINE_FIELDS = (
    "max_model_len",
    "gpu_memory_utilization",
    "max_num_batched_tokens",
    "max_num_seqs",
    "async_scheduling",
)
WORKLOAD_FIELDS = (
    "dataset",
    "input_len",
    "output_len",
    "num_prompts",
    "request_rate",
    "max_concurrency",
    "seeds",
)
# The compared figures: (name, reported keys in order of preference, simulated key for each).
FIGURES = (
    (
        "throughput",
        (("output_throughput", "output_throughput"), ("request_throughput", "request_throughput")),
    ),
    ("tpot_ms", (("median_tpot_ms", "median_tpot_ms"), ("tpot_ms", "mean_tpot_ms"))),
    ("ttft_ms", (("median_ttft_ms", "median_ttft_ms"), ("ttft_ms", "mean_ttft_ms"))),
)
# The end-to-end target: median |error| within this, none beyond MAX_BOUND.
MEDIAN_BOUND = 0.15
MAX_BOUND = 0.30


def _missing(obj: dict, fields: tuple[str, ...], where: str) -> list[str]:
    return [f"{where}: no {name!r}" for name in fields if name not in obj]


def check_file(data: dict, name: str) -> list[str]:
    """Every problem with one corpus file (empty when it is complete)."""
    problems = _missing(data, ("source", "deployment", "unknowns", "points"), name)
    if problems:
        return problems
    src, dep = data["source"], data["deployment"]
    problems += _missing(src, SOURCE_FIELDS, f"{name} source")
    if not str(src.get("url", "")).startswith("https://"):
        problems.append(f"{name} source: url {src.get('url')!r} is not an https address")
    problems += _missing(dep, DEPLOYMENT_FIELDS, f"{name} deployment")
    problems += _missing(dep.get("engine", {}), ENGINE_FIELDS, f"{name} deployment.engine")
    for u in data["unknowns"]:
        problems += _missing(u, ("what", "set_to", "why"), f"{name} unknowns")
    if not data["points"]:
        problems.append(f"{name}: no points")
    for p in data["points"]:
        where = f"{name} point {p.get('id', '?')}"
        problems += _missing(
            p, ("id", "bench_command", "workload", "simulated_output_len", "reported"), where
        )
        problems += _missing(p.get("workload", {}), WORKLOAD_FIELDS, f"{where} workload")
        for fig, choices in FIGURES:
            if not any(k in p.get("reported", {}) for k, _ in choices):
                problems.append(f"{where}: reports no {fig} ({' or '.join(k for k, _ in choices)})")
    return problems


def load_corpus(folder: Path = CORPUS) -> list[dict]:
    """Every point of the corpus, each with its file's source, deployment and unknowns; a bad file raises."""
    points: list[dict] = []
    files = sorted(folder.glob("*.json"))
    if not files:
        raise ValueError(f"no corpus files (*.json) in {folder}")
    for path in files:
        data = json.loads(path.read_text())
        problems = check_file(data, path.name)
        if problems:
            raise ValueError("; ".join(problems))
        for p in data["points"]:
            points.append(
                {**p, "file": path.name, "source": data["source"], "deployment": data["deployment"]}
            )
    ids = [p["id"] for p in points]
    if len(set(ids)) != len(ids):
        raise ValueError(f"point ids repeat: {sorted({i for i in ids if ids.count(i) > 1})}")
    return points


def h100_profile_from(version: str, out: Path) -> Path:
    """A profile file: the built-in h100 with its kernel fit redone from Vidur's ``version`` H100 op rows."""
    from llmsched.executor.sim.fitted_kernels import KERNEL_FITS
    from llmsched.executor.sim.hardware import BUILTIN_HARDWARE
    from llmsched.sim.calibrate_vidur import TRUSTED_VERSION, fit_kernels
    from llmsched.sim.vidur_data import read_compact

    data = read_compact(VIDUR)
    ops = [r for r in data.ops if r.gpu == "h100" and r.version == version]
    if not ops:
        raise SystemExit(f"no H100 op rows of Vidur version {version!r} in {VIDUR}")
    # As tools/fit_vidur_profiles.py: H100 has no attention rows and borrows A100's attention terms.
    attention = {k: v for k, v in KERNEL_FITS["a100"].items() if k.startswith(("attn_prefill", "decode_"))}
    coll = [
        r
        for r in data.collectives
        if r.gpu == "h100" and r.collective == "all_reduce" and r.version == TRUSTED_VERSION["h100"]
        and r.topology in ("dgx", "node")
    ]  # fmt: skip
    hw = BUILTIN_HARDWARE["h100"]
    fit = fit_kernels(ops, [], coll, hw, attention_fallback=attention, source=f"Vidur {version} h100 ops")
    profile = hw.to_dict() | {"name": f"h100-{version}", "kernel_fit": fit.to_dict()}
    out.write_text(json.dumps(profile, default=list))
    return out


def request_s(point: dict) -> float:
    """The API server's fixed seconds per request for the endpoint the point's bench command used."""
    return CHAT_REQUEST_S if "/v1/chat/completions" in point["bench_command"] else DEFAULT_REQUEST_S


def simulate_args(
    point: dict, seed: int, hardware: dict[str, str] | None = None, frontend: bool = True
) -> list[str]:
    """The `llmsched simulate` arguments that reproduce one point's deployment and workload with ``seed``."""
    dep, eng, wl = point["deployment"], point["deployment"]["engine"], point["workload"]
    if wl["dataset"] != "random":
        raise ValueError(f"{point['id']}: only random-dataset points are simulated, not {wl['dataset']!r}")
    args = [
        "simulate",
        "--model", dep["sim_model"],
        "--hardware", (hardware or {}).get(dep["sim_hardware"], dep["sim_hardware"]),
        "--tensor-parallel-size", str(dep["tensor_parallel_size"]),
        "--max-model-len", str(eng["max_model_len"]),
        "--gpu-memory-utilization", str(eng["gpu_memory_utilization"]),
        "--max-num-batched-tokens", str(eng["max_num_batched_tokens"]),
        "--max-num-seqs", str(eng["max_num_seqs"]),
        "--async-scheduling" if eng["async_scheduling"] else "--no-async-scheduling",
        "--input-len", str(wl["input_len"]),
        "--output-len", str(point["simulated_output_len"]),
        "--range-ratio", "0",
        "--num-prompts", str(wl["num_prompts"]),
        "--request-rate", str(wl["request_rate"]),
        "--seed", str(seed),
        "--disable-tqdm",
    ]  # fmt: skip
    if wl["max_concurrency"] is not None:
        args += ["--max-concurrency", str(wl["max_concurrency"])]
    if frontend:
        args += ["--api-server-count", str(dep["api_server_count"])]
        args += ["--api-server-us-per-request", f"{request_s(point) * 1e6:g}"]
    return args


def run_simulate(args: list[str]) -> dict:
    """One `llmsched simulate` run in this process; its result JSON."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
            rc = llmsched_main([*args, "--result-json", str(out)])
        if rc != 0:
            raise RuntimeError(f"llmsched {' '.join(args)} failed ({rc}): {printed.getvalue()[-2000:]}")
        return json.loads(out.read_text())


def _mean_over_seeds(runs: list[dict], key: str) -> float:
    return statistics.fmean(r[key] for r in runs)


def api_busy_share(runs: list[dict]) -> float | None:
    """The simulated API servers' work over the run's duration, averaged over seeds (None: not modelled)."""
    fes = [r["simulation"].get("frontend") for r in runs]
    if any(fe is None or "busy_s" not in fe for fe in fes):
        return None
    return statistics.fmean(
        fe["busy_s"] / (r["duration"] * fe["api_server_count"]) for fe, r in zip(fes, runs, strict=True)
    )


def compare(point: dict, runs: list[dict], frontend: bool = True) -> dict:
    """Published against simulated figures (the simulated ones averaged over the point's seeds)."""
    rep = point["reported"]
    figures = {}
    for fig, choices in FIGURES:
        rep_key, sim_key = next((k, s) for k, s in choices if k in rep)
        sim = _mean_over_seeds(runs, sim_key)
        figures[fig] = {
            "published_key": rep_key,
            "simulated_key": sim_key,
            "published": rep[rep_key],
            "simulated": sim,
            "error": sim / rep[rep_key] - 1,
        }
    mem = runs[0]["deployment"]["memory"]
    sims = [r["simulation"] for r in runs]
    return {
        "id": point["id"],
        "file": point["file"],
        "url": point["source"]["url"],
        "args": simulate_args(point, point["workload"]["seeds"][0], frontend=frontend),
        "figures": figures,
        "simulated": {
            "duration_s": _mean_over_seeds(runs, "duration"),
            "api_server_busy_share": api_busy_share(runs),
            "kv_cache_tokens": mem["kv_cache_tokens"],
            "preemptions": statistics.fmean(s["num_preemptions"] for s in sims),
            "max_running": max(s["max_running"] for s in sims),
            "mean_model_ms_per_step": statistics.fmean(s["step_costs"]["mean_model_ms"] for s in sims),
        },
        "published_duration_s": point["reported"].get("duration_s"),
    }


def summarize(rows: list[dict]) -> dict:
    """Median and max |error| per figure over the points, and whether the end-to-end target holds."""
    out = {}
    for fig, _ in FIGURES:
        errs = [abs(r["figures"][fig]["error"]) for r in rows]
        out[fig] = {"n": len(errs), "median_abs_error": statistics.median(errs), "max_abs_error": max(errs)}
    for fig in ("throughput", "tpot_ms"):
        s = out[fig]
        s["target_holds"] = s["median_abs_error"] <= MEDIAN_BOUND and s["max_abs_error"] <= MAX_BOUND
    return out


def _fmt(v: float) -> str:
    return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.2f}"


def print_table(rows: list[dict], summary: dict) -> None:
    """The comparison, one line per point and figure, then the summary."""
    print(
        f"{'point':48} {'figure':10} {'published':>12} {'simulated':>12} {'error':>8}"
        "   sim: KV tokens, preemptions, API server busy"
    )
    for r in rows:
        for fig, f in r["figures"].items():
            label = f"{fig} ({f['published_key']})" if fig == "throughput" else fig
            extra = ""
            if fig == "throughput":
                s = r["simulated"]
                extra = f"   {s['kv_cache_tokens']:,}, {s['preemptions']:.0f}"
                if s["api_server_busy_share"] is not None:
                    extra += f", {s['api_server_busy_share']:.0%}"
            print(
                f"{r['id']:48} {label[:10]:10} {_fmt(f['published']):>12} {_fmt(f['simulated']):>12} "
                f"{f['error']:>+8.1%}{extra}"
            )
    print()
    for fig, s in summary.items():
        held = (
            ""
            if "target_holds" not in s
            else f"  (target: median <= 15%, max <= 30%: {'holds' if s['target_holds'] else 'misses'})"
        )
        print(
            f"{fig:10} over {s['n']} points: median |error| {s['median_abs_error']:.1%},"
            f" max {s['max_abs_error']:.1%}{held}"
        )


def run_points(
    points: list[dict], hardware: dict[str, str] | None = None, frontend: bool = True
) -> list[dict]:
    """Every point simulated (once per seed) and compared; ``hardware`` swaps profile names for files."""
    rows = []
    for p in points:
        runs = [run_simulate(simulate_args(p, seed, hardware, frontend)) for seed in p["workload"]["seeds"]]
        row = compare(p, runs, frontend)
        row["args"] = simulate_args(p, p["workload"]["seeds"][0], hardware, frontend)
        rows.append(row)
        print(f"simulated {p['id']}", file=sys.stderr)
    return rows


def main(argv: list[str] | None = None) -> int:
    """Simulate every corpus point, print the errors and write the JSON."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--corpus", type=Path, default=CORPUS, help="folder of corpus files (default benchmarks/published)"
    )
    ap.add_argument(
        "--only", action="append", help="simulate only points whose id contains this (repeatable)"
    )
    ap.add_argument(
        "--h100-ops",
        metavar="VERSION",
        help="also simulate the H100 points on a fit to this Vidur H100 profile",
    )
    ap.add_argument(
        "--no-frontend",
        action="store_true",
        help="simulate the engine alone: every request reaches it when sent, tokens are seen when made",
    )
    ap.add_argument("--json", type=Path, default=Path("results/sim_vs_published.json"))
    args = ap.parse_args(argv)
    points = load_corpus(args.corpus)
    if args.only:
        points = [p for p in points if any(s in p["id"] for s in args.only)]
        if not points:
            raise SystemExit(f"no point id contains any of {args.only}")
    frontend = not args.no_frontend
    rows = run_points(points, frontend=frontend)
    summary = summarize(rows)
    print_table(rows, summary)
    result = {"corpus": str(args.corpus), "frontend": frontend, "points": rows, "summary": summary}
    if args.h100_ops:
        h100 = [p for p in points if p["deployment"]["sim_hardware"] == "h100"]
        with tempfile.TemporaryDirectory() as tmp:
            profile = h100_profile_from(args.h100_ops, Path(tmp) / f"h100-{args.h100_ops}.json")
            alt = run_points(h100, {"h100": str(profile)}, frontend)
        alt_summary = summarize(alt)
        print(
            f"\nH100 points on a kernel fit to Vidur's {args.h100_ops} H100 op rows"
            " (diagnosis, not the built-in h100):"
        )
        print_table(alt, alt_summary)
        result["h100_ops_variant"] = {"vidur_version": args.h100_ops, "points": alt, "summary": alt_summary}
    record_cpu(result)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
