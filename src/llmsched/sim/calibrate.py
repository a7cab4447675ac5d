"""The ``cpu`` hardware profile, measured on this machine and cached on disk.

With torch installed the profile describes this project's torch executor
running a model eagerly on this CPU, in the dtype its ``auto`` picks here
(bfloat16 with bfloat16 matmuls, else float32): ``calibrate_torch`` measures the
matmul peak, the copy bandwidth, the weight-streaming and prefill
attention efficiencies, then ``calibrate_executor`` times decode steps of a
throwaway model through the executor itself (in a child process) and fits
its host costs (per step, per layer, per request) and the rate at which its
decode attention reads the KV cache. Should that fail (no safetensors, say),
single-op microbenchmarks stand in for the last two. Without torch only the
matmul throughput (numpy, else pure Python) and the memory bandwidth (a
large buffer copy) are measured.

A calibration once measured half the matmul peak without noticing. Two
causes explain that on a small shared machine: the first bf16 matmul of a
shape is several times slower than the next (oneDNN builds its primitive,
pages fault in), and a neighbour holding one of two cores halves a
two-thread matmul, whose every parallel region waits for its slowest
thread, while the readings stay steady. The old check averaged other
processes' CPU time over the whole calibration, where a burst during the
0.1 s matmul vanished. Now every figure is timed until its readings settle
and agree (``settle``), in its own window checked for other processes' CPU
time (``machine_load``), re-measured when disturbed; the machine is checked
idle before and after; and the executor probe's process measures the
matmul peak again before and after its steps, which must match. A
calibration that fails any of these is ``settled: false``, says why, and
is not cached.

A settled result is cached per machine and backend in
``$LLMSCHED_CACHE_DIR/cpu-calibration.json`` (default ``~/.cache/llmsched``),
so only the first simulation on a machine pays the few seconds it takes;
``llmsched calibrate`` writes it as a named profile file instead.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import re
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

from llmsched.executor.sim import hardware
from llmsched.executor.sim.hardware import HardwareProfile
from llmsched.sim import machine_load
from llmsched.sim.settle import Limits, Reading
from llmsched.sim.settle import measure as measure_figure

CACHE_FILE = "cpu-calibration.json"
# Bumped when the measurements change meaning, or the executor they time
# changes speed (5: the C decode attention; 6: the C prefill attention and
# RMSNorm; 7: timed in the executor's auto dtype, float32 on CPUs without
# bfloat16 matmuls; 8: the weight stream and the executor probe counted in
# that dtype's bytes, and the linears' and prefill attention's efficiency
# curves; 9: the linears timed at every row count to 8), so older cached
# entries are measured again rather than read with the wrong sense.
_VERSION = 9
# Test-sized limits: fewer calls and shorter readings, one attempt.
QUICK_LIMITS = Limits(max_calls=6, min_reading_s=0.005, max_seconds=0.5, attempts=1)
# The executor probe runs a few seconds; beyond this something is wrong.
_PROBE_TIMEOUT_S = 300
_PROBE_ATTEMPTS = 2
# The executor process's own matmul peak must match the microbenchmark's
# within this, and the probe's steps their fit within _MAX_FIT_ERROR RMS.
_CROSS_CHECK_TOLERANCE = 0.10
_MAX_FIT_ERROR = 0.30

log = logging.getLogger(__name__)


def cache_dir() -> Path:
    """Where the calibration is cached."""
    env = os.environ.get("LLMSCHED_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "llmsched"


def backend() -> str:
    """The array library the matmul benchmark uses: torch, numpy or python."""
    for name in ("torch", "numpy"):
        try:
            __import__(name)
            return name
        except ImportError:
            continue
    return "python"


def machine_key(backend_name: str) -> str:
    """Identifies the machine and backend a calibration is valid for."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    key = f"{platform.node()}|{cpu}|{os.cpu_count()}|{backend_name}|v{_VERSION}"
    if backend_name == "torch":
        from llmsched.executor.torch.kernels import enabled

        # The executor probe times the torch executor, whose decode runs
        # the C kernels unless they are switched off.
        key += "" if enabled() else "|no-cpu-kernels"
    return key


def _matmul_bench(name: str) -> tuple[float, Callable[[], object]]:
    """Float32 matmul FLOPs per call with numpy, else pure Python, and the call."""
    if name == "numpy":
        import numpy as np

        n = 512
        rng = np.random.default_rng(0)
        a = rng.random((n, n), dtype=np.float32)
        b = rng.random((n, n), dtype=np.float32)
        return 2 * n**3, lambda: a @ b
    n = 48
    a = [[float(i * n + j) for j in range(n)] for i in range(n)]
    bt = [[float(j * n + i) for j in range(n)] for i in range(n)]
    return 2 * n**3, lambda: [[sum(x * y for x, y in zip(row, col)) for col in bt] for row in a]


def _copy_bench(nbytes: int = 64 << 20) -> tuple[float, Callable[[], object]]:
    """Bytes (read + write) per call of a large memcpy, and the call."""
    src = bytearray(nbytes)
    dst = bytearray(nbytes)

    def run() -> None:
        dst[:] = src

    return 2 * nbytes, run


def _total_memory() -> float:
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return float(16 << 30)


def _executor_figures(figures: dict) -> dict | None:
    """The executor probe's fit, run in a child process; None if it could not run."""
    import llmsched

    # A child keeps the executor's process-wide settings (malloc thresholds,
    # thread pool) and its memory out of this process, where they would skew
    # any microbenchmark measured later.
    env = dict(os.environ)
    src = str(Path(llmsched.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
    try:
        done = subprocess.run(
            [sys.executable, "-m", "llmsched.sim.calibrate_executor"],
            input=json.dumps(figures),
            capture_output=True,
            text=True,
            env=env,
            timeout=_PROBE_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        log.warning("executor calibration did not run (%s); using microbenchmarks", e)
        return None
    if done.returncode != 0:
        tail = done.stderr.strip().splitlines()[-1:] or ["no output"]
        log.warning("executor calibration failed (%s); using microbenchmarks", tail[0])
        return None
    try:
        return json.loads(done.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        log.warning("executor calibration printed no figures; using microbenchmarks")
        return None


def machine_info() -> dict:
    """The machine and library versions a calibration was taken with."""
    import llmsched

    info = {
        "node": platform.node(),
        "cpu": machine_key("").split("|")[1],
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "llmsched": llmsched.__version__,
    }
    try:
        import torch

        info["torch"] = torch.__version__
        info["threads"] = torch.get_num_threads()
        found = re.search(r"(MKL-DNN|oneDNN) v([\d.]+)", torch.__config__.parallel_info())
        if found:
            info["onednn"] = found.group(2)
    except ImportError:
        pass
    return info


def _probe_check(peak: float, probe: dict, limits: Limits) -> list[str]:
    """The executor process's matmul peak against this one's, and the probe fit's own misses."""
    problems = []
    for r in probe.get("readings", []):
        ratio = r["value"] / peak
        if abs(ratio - 1.0) > _CROSS_CHECK_TOLERANCE:
            problems.append(
                f"{r['name']}: {r['value'] / 1e9:.0f} GFLOP/s in the executor probe's process against "
                f"{peak / 1e9:.0f} here ({100 * (ratio - 1):+.0f}%, "
                f"limit {100 * _CROSS_CHECK_TOLERANCE:.0f}%)"
            )
    if probe.get("fit_rms_error", 0.0) > _MAX_FIT_ERROR:
        problems.append(
            f"the executor probe's steps disagree with their fit by {100 * probe['fit_rms_error']:.0f}% "
            f"RMS (limit {100 * _MAX_FIT_ERROR:.0f}%)"
        )
    return problems


def _torch_figures(limits: Limits, quick: bool) -> tuple[dict, list[Reading], list[str]]:
    """Microbenchmarks, then the executor probe (unless quick), each load-checked, and their problems."""
    from llmsched.sim.calibrate_torch import FULL, QUICK, host_figures, measure_torch

    sizes = QUICK if quick else FULL
    figures, readings = measure_torch(limits, sizes)
    problems: list[str] = []
    probe = None
    if not quick:
        request = dict(figures, matmul_n=sizes.matmul_n, limits=asdict(limits))
        for _ in range(_PROBE_ATTEMPTS):
            before = machine_load.sample()
            probe = _executor_figures(request)
            share = machine_load.foreign_share(before, machine_load.sample())
            if probe is None or share <= limits.max_foreign_share:
                break
        if probe is not None:
            probe["probe_foreign_share"] = round(share, 3)
            if share > limits.max_foreign_share:
                problems.append(
                    f"executor probe: other processes used {100 * share:.0f}% of the cores while it ran "
                    f"(limit {100 * limits.max_foreign_share:.0f}%)"
                )
            problems += _probe_check(figures["peak_flops"], probe, limits)
    if probe is None:
        host, more = host_figures(limits, sizes)
        figures.update(host)
        readings += more
    else:
        figures.update({k: v for k, v in probe.items() if k != "readings"})
        readings += [Reading(**r) for r in probe.get("readings", [])]
    return figures, readings, problems


def _plain_figures(name: str, limits: Limits) -> tuple[dict, list[Reading]]:
    """Matmul and copy rates with numpy or pure Python (no torch)."""
    readings = [
        measure_figure("peak_flops", *_matmul_bench(name), limits),
        measure_figure("mem_bandwidth", *_copy_bench(), limits),
    ]
    return {r.name: r.value for r in readings}, readings


def measure(quick: bool = False, limits: Limits | None = None) -> dict:
    """Measure now, each figure settled and load-checked, with the verdict; no caching.

    ``quick`` uses small problem sizes and skips the executor probe (seconds,
    for tests). The result's ``settled`` is False, and ``problems`` says
    why, when a figure did not settle, other processes used more than the
    tolerated share of the cores before, during or after, or the executor
    probe's own matmul peak disagrees with the microbenchmark's.
    """
    limits = limits or (QUICK_LIMITS if quick else Limits())
    name = backend()
    quiet_s = 0.2 if quick else 0.5
    before = machine_load.quiet_check(quiet_s)
    start = machine_load.sample(with_processes=True)
    t = time.perf_counter()
    if name == "torch":
        figures, readings, problems = _torch_figures(limits, quick)
    else:
        (figures, readings), problems = _plain_figures(name, limits), []
    seconds = time.perf_counter() - t
    end = machine_load.sample(with_processes=True)
    after = machine_load.quiet_check(quiet_s)
    problems = [p for r in readings if (p := r.problem(limits))] + problems
    for when, check in (("before", before), ("after", after)):
        if check.share > limits.max_foreign_share:
            problems.append(f"{when} measuring: {check.describe()}")
    return {
        "backend": name,
        **figures,
        "mem_capacity": _total_memory(),
        "seconds": round(seconds, 3),
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "settled": not problems,
        "problems": problems,
        "readings": [r.to_dict() for r in readings],
        "load": {
            "before": before.share,
            "during": round(machine_load.foreign_share(start, end), 3),
            "after": after.share,
            "busiest_others": machine_load.busiest_others(start, end),
        },
        "machine": machine_info(),
    }


def calibration(recalibrate: bool = False) -> dict:
    """The cached figures for this machine and backend, measured if absent.

    Only a settled calibration is cached: an unsettled one is returned (with
    a warning naming its problems) for this run alone, and the next run
    measures again.
    """
    name = backend()
    key = machine_key(name)
    path = cache_dir() / CACHE_FILE
    cached: dict = {}
    if path.is_file():
        try:
            cached = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            cached = {}
    if not recalibrate and isinstance(cached.get(key), dict) and cached[key].get("settled"):
        return cached[key]
    result = measure()
    if not result["settled"]:
        log.warning("the cpu calibration did not settle and is not cached: %s", "; ".join(result["problems"]))
        return result
    cached[key] = result
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(cached, indent=2))
        tmp.replace(path)
    except OSError:
        pass  # an unwritable cache only costs a re-measurement next time
    return result


def _summary(c: dict) -> str:
    """The measured figures in a few words, for the profile's description."""
    dtype = f" {c['dtype']}" if "dtype" in c else ""
    parts = [f"{c['peak_flops'] / 1e9:.1f}{dtype} GFLOP/s", f"{c['mem_bandwidth'] / 1e9:.1f} GB/s"]
    gemm = (c.get("efficiency_curves") or {}).get("gemm")
    if gemm:
        (lo_rows, lo), (hi_rows, hi) = gemm[0], gemm[-1]
        parts.append(f"linears {lo:.2f}-{hi:.2f} of the peak at {lo_rows}-{hi_rows} rows")
    if c.get("decode_kv_bandwidth"):
        parts.append(f"decode KV {c['decode_kv_bandwidth'] / 1e9:.1f} GB/s")
    if "step_overhead_s" in c:
        parts.append(
            f"host {c['step_overhead_s'] * 1e3:.2f} ms/step + {c.get('layer_overhead_s', 0.0) * 1e3:.2f} "
            f"ms/layer + {c.get('request_overhead_s', 0.0) * 1e6:.0f} us/request"
        )
    return ", ".join(parts)


def load_hardware(name_or_path: str, *, recalibrate: bool = False) -> HardwareProfile:
    """A built-in profile by name, ``cpu`` (calibrated here), or a JSON file (calibrated or bare fields)."""
    if name_or_path.strip().lower() == "cpu":
        return cpu_profile(recalibrate=recalibrate)
    return hardware.load_hardware(name_or_path)


def cpu_profile(recalibrate: bool = False) -> HardwareProfile:
    """This machine's CPU as a hardware profile: measured peaks, attention rates and host overhead."""
    return profile_from_calibration(calibration(recalibrate))


def _largest_probe_batch(c: dict) -> int:
    """The most decodes in one of the executor probe's timed steps (0: no probe ran)."""
    samples = c.get("executor_samples") or []
    return max((int(s[1]) for s in samples), default=0)


def _core_left_for_host(machine: dict) -> bool:
    """Whether the calibrated model threads left a core for the engine thread (unknown: assumed so)."""
    threads, cores = machine.get("threads"), machine.get("cores")
    if not isinstance(threads, int) or not isinstance(cores, int):
        return True
    return threads < cores


def profile_from_calibration(c: dict, name: str = "cpu") -> HardwareProfile:
    """The hardware profile a calibration's figures describe (flagged in its description if unsettled)."""
    efficiency = None
    if "attention_efficiency" in c:
        # Calibrations since version 8 also measure how the linears' and
        # prefill attention's efficiencies follow their size
        # (efficiency_curves, which then price those ops); before, the
        # linears were priced at a GPU profile's constant 0.7 of the peak.
        efficiency = {"attention": c["attention_efficiency"], "memory": c["memory_efficiency"]}
    unsettled = "" if c.get("settled", True) else " UNSETTLED: " + "; ".join(c.get("problems", []))
    return HardwareProfile(
        name=name,
        description=f"this machine's CPU, calibrated with {c['backend']} ({_summary(c)}){unsettled}",
        peak_flops_bf16=c["peak_flops"],
        peak_flops_fp8=None,
        mem_bandwidth=c["mem_bandwidth"],
        mem_capacity=c["mem_capacity"],
        # Tensor-parallel ranks on one host talk through shared memory.
        link_bandwidth=c["mem_bandwidth"] / 2,
        collective_latency_s=20e-6,
        # PyTorch on a CPU has no graphs to replay: every step runs eagerly
        # and pays the measured host costs (per step, layer and request)
        # instead of launches.
        cuda_graphs=False,
        layer_overhead_s=c.get("layer_overhead_s", 0.0),
        # The layers' host time was fitted from the executor's own decode
        # steps of up to this many requests (see CostModel._layer_overhead).
        # With measured GEMM curves the linears are timed on their own, on
        # weights larger than the caches, and their time adds to the host's.
        layer_overhead_covers_tokens=0 if c.get("efficiency_curves") else _largest_probe_batch(c),
        host_overlaps_model=_core_left_for_host(c.get("machine", {})),
        step_overhead_s=c.get("step_overhead_s"),
        request_overhead_s=c.get("request_overhead_s", 0.0),
        decode_kv_bandwidth=c.get("decode_kv_bandwidth"),
        efficiency=efficiency,
        efficiency_curves=c.get("efficiency_curves"),
    )
