"""Host costs and the decode KV read rate of the torch executor, timed on its own code path.

Microbenchmarks of single ops (``calibrate_torch``) give the matmul peak and
the memory bandwidth, but not what an eager engine step costs around them:
preparing the step's inputs, the Python and dispatch of every layer's ops,
sampling, and the way the executor gathers paged KV for decodes. Those are
measured here by running decode steps of a throwaway model (random weights,
written to a temporary folder) through ``TorchExecutor`` itself, at two layer
counts, two batch sizes and two context lengths, and fitting

    measured - priced arithmetic = step + layers x layer + decodes x request + KV bytes / rate

where "priced arithmetic" is what the cost model already charges for the
linears, norms, LM head and sampler at the microbenchmarked rates. The model
is shaped so that this arithmetic is small (narrow hidden size, tiny vocab)
while the attention core has a usual shape (64-wide heads, GQA group 2).
Every timed step starts with cold caches: in serving, a decode's cached KV
was written steps ago and the weights and other requests' KV have passed
through the caches since, so its reads come from memory; a probe that read
back what its prefill just wrote would see the last-level cache instead.

Runs in a child process (``python -m llmsched.sim.calibrate_executor``)
so the executor's process-wide settings (allocator, threads) never leak into
the caller or into microbenchmarks measured after it.
"""

from __future__ import annotations

import json
import math
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from llmsched.executor.sim.hardware import HardwareProfile
    from llmsched.executor.sim.model_shapes import ModelShape

T = TypeVar("T")

# A Llama with the attention core of common small models (64-wide heads,
# two query heads per KV head) around a narrow residual stream, so linears,
# norms and the LM head cost little next to the host work being measured.
PROBE_CONFIG: dict = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 128,
    "intermediate_size": 128,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "vocab_size": 512,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
}
# Two layer counts separate the per-layer host cost from the per-step one.
PROBE_LAYERS = (1, 4)
# (decodes, context tokens) per measured batch: one and many requests, short
# and long contexts. The long batch's KV (32 x 512 tokens x 1 KiB per layer)
# outgrows a last-level cache at 4 layers, as a serving batch's does.
PROBE_BATCHES = ((1, 32), (1, 512), (32, 32), (32, 512))
# Decode steps timed per batch, after warm-up steps that let buffers grow
# and kernels be chosen. The median step counts: the fastest of several
# would be the one whose reads happened to find the most in cache, which a
# serving step (timed over hundreds of steps) does not.
PROBE_STEPS = 8
PROBE_WARMUP = 2
# Every batch is measured this many times, the passes seconds apart, and the
# fastest counts: on a shared machine a neighbour's burst can slow a whole
# batch's consecutive steps, rarely both passes.
PROBE_PASSES = 2


@dataclass(frozen=True, slots=True)
class StepSample:
    """One timed decode step: its shape and the seconds it took beyond the priced arithmetic."""

    layers: int
    decodes: int
    kv_bytes: float
    residual_s: float


@dataclass(frozen=True, slots=True)
class HostFit:
    """The fitted per-step, per-layer and per-request host costs and the decode KV read rate."""

    step_overhead_s: float
    layer_overhead_s: float
    request_overhead_s: float
    decode_kv_bandwidth: float


def fit_host_costs(samples: Sequence[StepSample]) -> HostFit:
    """Least-squares fit of residual = step + layers x layer + decodes x request + bytes / rate."""
    rows = [(1.0, float(s.layers), float(s.decodes), s.kv_bytes) for s in samples]
    ys = [s.residual_s for s in samples]
    coef = _lstsq(rows, ys)
    # A term the data cannot see (noise pushing it below zero) costs nothing
    # rather than giving time back: refit without it.
    while any(c < 0 for c in coef):
        drop = min(range(len(coef)), key=lambda i: coef[i])
        keep = [i for i in range(len(coef)) if coef[i] > 0 and i != drop]
        sub = _lstsq([[r[i] for i in keep] for r in rows], ys)
        coef = [0.0] * len(coef)
        for i, c in zip(keep, sub):
            coef[i] = c
    step, layer, request, per_byte = coef
    return HostFit(step, layer, request, 1.0 / per_byte if per_byte > 0 else math.inf)


def fit_rms_error(fit: HostFit, samples: Sequence[StepSample]) -> float:
    """Root mean square of the fit's misses on its own samples over their mean: large when steps disagree."""
    if not samples:
        return 0.0
    per_byte = 1.0 / fit.decode_kv_bandwidth if math.isfinite(fit.decode_kv_bandwidth) else 0.0
    misses = []
    for s in samples:
        model = (
            fit.step_overhead_s + s.layers * fit.layer_overhead_s + s.decodes * fit.request_overhead_s
        ) + s.kv_bytes * per_byte
        misses.append(model - s.residual_s)
    # Over the mean residual, not each one's: a small residual would make
    # a microsecond's miss look enormous.
    mean = sum(s.residual_s for s in samples) / len(samples)
    return math.sqrt(sum(m * m for m in misses) / len(misses)) / max(abs(mean), 1e-9)


def _lstsq(rows: Sequence[Sequence[float]], ys: Sequence[float]) -> list[float]:
    """Least squares via the normal equations (a handful of unknowns, well scaled by column)."""
    k = len(rows[0]) if rows else 0
    if k == 0:
        return []
    # Scale each column to unit size so the byte counts (1e7) and the unit
    # columns condition the system alike.
    scale = [max(abs(r[j]) for r in rows) or 1.0 for j in range(k)]
    a = [[r[j] / scale[j] for j in range(k)] for r in rows]
    m = [[sum(r[i] * r[j] for r in a) for j in range(k)] for i in range(k)]
    v = [sum(r[i] * y for r, y in zip(a, ys)) for i in range(k)]
    # Gaussian elimination with partial pivoting.
    for c in range(k):
        p = max(range(c, k), key=lambda i: abs(m[i][c]))
        m[c], m[p], v[c], v[p] = m[p], m[c], v[p], v[c]
        if abs(m[c][c]) < 1e-12:
            continue
        for i in range(c + 1, k):
            f = m[i][c] / m[c][c]
            for j in range(c, k):
                m[i][j] -= f * m[c][j]
            v[i] -= f * v[c]
    x = [0.0] * k
    for c in reversed(range(k)):
        if abs(m[c][c]) < 1e-12:
            continue
        x[c] = (v[c] - sum(m[c][j] * x[j] for j in range(c + 1, k))) / m[c][c]
    return [x[j] / scale[j] for j in range(k)]


def write_probe_model(folder: Path, layers: int, seed: int = 0) -> None:
    """The probe model as a Hugging Face folder: config.json and random safetensors in the compute dtype."""
    import torch
    from safetensors.torch import save_file

    from llmsched.sim.calibrate_torch import compute_dtype, dtype_name

    dtype = compute_dtype()
    c = dict(PROBE_CONFIG, num_hidden_layers=layers, torch_dtype=dtype_name(dtype))
    h, inter, hd = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (c["vocab_size"], h),
        "model.norm.weight": (h,),
        "lm_head.weight": (c["vocab_size"], h),
    }
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update(
            {
                p + "input_layernorm.weight": (h,),
                p + "post_attention_layernorm.weight": (h,),
                p + "self_attn.q_proj.weight": (q, h),
                p + "self_attn.k_proj.weight": (kv, h),
                p + "self_attn.v_proj.weight": (kv, h),
                p + "self_attn.o_proj.weight": (h, q),
                p + "mlp.gate_proj.weight": (inter, h),
                p + "mlp.up_proj.weight": (inter, h),
                p + "mlp.down_proj.weight": (h, inter),
            }
        )
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in shapes.items():
        w = torch.ones(shape) if name.endswith("norm.weight") else torch.randn(shape, generator=gen) * 0.05
        tensors[name] = w.to(dtype).contiguous()
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(c, indent=2))
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})


def last_level_cache_bytes() -> int:
    """Size of the CPU's largest cache (Linux sysfs), else 64 MiB."""
    best = 0
    for path in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
        mult = units.get(text[-1:].upper(), 1)
        digits = text[:-1] if text[-1:].upper() in units else text
        if digits.isdigit():
            best = max(best, int(digits) * mult)
    return best or 64 << 20


def cache_flusher() -> Callable[[], None]:
    """A call that evicts the caches by rewriting a buffer twice the last-level cache.

    It runs single threaded on the caller's thread: a parallel op here would
    give this thread an OpenMP team of its own beside the executor's, and
    libgomp then cuts every team's spin-waiting short (see TorchExecutor), so
    each of the probe's parallel ops would pay a wake-up that a serving
    step, with one team in the process, does not.
    """
    import torch

    from llmsched.executor.torch.device import single_threaded

    buf = torch.zeros(2 * last_level_cache_bytes() // 4, dtype=torch.float32)

    def flush() -> None:
        with single_threaded():
            buf.add_(1.0)

    return flush


def probe_shape(layers: int) -> ModelShape:
    """The probe model as the cost model prices it, in the dtype it is written and runs in.

    Its KV cache and weights are float32 where the executor runs float32;
    priced as bfloat16 they halved the fitted decode KV read rate.
    """
    from llmsched.executor.sim.model_shapes import shape_from_hf_config
    from llmsched.sim.calibrate_torch import compute_dtype, dtype_name

    config = dict(PROBE_CONFIG, num_hidden_layers=layers, torch_dtype=dtype_name(compute_dtype()))
    return shape_from_hf_config(config, "probe")


def time_decode_steps(folder: Path, layers: int, hardware: HardwareProfile) -> list[StepSample]:
    """Decode steps of every PROBE_BATCHES batch on a TorchExecutor, less the cost model's arithmetic."""
    from llmsched.core import ModelRunnerOutput, Request, SamplingParams, SchedulerConfig, SchedulerOutput
    from llmsched.engine import EngineCore
    from llmsched.executor.sim.cost_model import CostModel
    from llmsched.executor.sim.executor import SimExecutor
    from llmsched.executor.torch import TorchExecutor
    from llmsched.executor.torch.device import DEFAULT_BLOCK_SIZE
    from llmsched.sim.calibrate_torch import compute_dtype, dtype_name

    # The block size the executor runs with on CPU by default.
    block_size = DEFAULT_BLOCK_SIZE["cpu"]
    seqs = max(b for b, _ in PROBE_BATCHES)
    longest = max(c for _, c in PROBE_BATCHES) + PROBE_WARMUP + PROBE_STEPS + 1
    blocks = seqs * -(-longest // block_size) + 1
    tokens = max(b * c for b, c in PROBE_BATCHES)
    ex = TorchExecutor(
        folder,
        dtype=dtype_name(compute_dtype()),
        block_size=block_size,
        max_model_len=longest,
        max_num_batched_tokens=tokens,
        max_num_seqs=seqs,
        num_gpu_blocks=blocks,
    )
    config = SchedulerConfig(
        num_gpu_blocks=ex.num_gpu_blocks,
        max_model_len=ex.max_model_len,
        max_num_batched_tokens=tokens,
        max_num_seqs=seqs,
        block_size=block_size,
        enable_prefix_caching=False,
        # The fit is of a sync step (host path plus model, back to back),
        # as the cost model prices one; Timed runs each step in execute().
        async_scheduling=False,
    )
    shape = probe_shape(layers)
    # Only the arithmetic: host costs and the decode KV read are what is fitted.
    priced = CostModel(shape, hardware, step_overhead_s=0.0, cuda_graph_max_tokens=0)
    probe = SimExecutor(priced)
    flush = cache_flusher()
    current: list[tuple[float, float, float]] = []

    class Timed:
        """The executor, each decode-only step timed and priced."""

        def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
            """Price the batch (the probe changes no request state), then run and time it."""
            probe.execute(so)
            flush()
            t = time.perf_counter()
            out = ex.execute(so)
            dt = time.perf_counter() - t
            b = probe.last_batch
            if b.num_decodes and not b.prefill_tokens:
                ops = {op.name: op for op in priced.ops(b)}
                attn = ops["attention_decode"]
                rest = sum(op.seconds for op in ops.values()) - attn.seconds
                current.append((dt, rest, attn.bytes))
            return out

        def close(self) -> None:
            """Nothing: closed below."""

    engine = EngineCore(config, Timed())
    vocab = PROBE_CONFIG["vocab_size"]
    best: dict[tuple[int, int], StepSample] = {}
    for n, (batch, context) in enumerate(PROBE_BATCHES * PROBE_PASSES):
        current.clear()
        params = SamplingParams(max_tokens=PROBE_WARMUP + PROBE_STEPS + 1, temperature=0.0, ignore_eos=True)
        for i in range(batch):
            prompt = [(n * 7919 + i * 31 + j) % vocab for j in range(context)]
            engine.add_request(Request(f"p{n}-{i}", prompt, params))
        while engine.has_requests():
            engine.step()
        timed = sorted(current[PROBE_WARMUP:] or current)
        dt, rest, kv_bytes = timed[(len(timed) - 1) // 2]
        sample = StepSample(layers, batch, kv_bytes, dt - rest)
        key = (batch, context)
        if key not in best or sample.residual_s < best[key].residual_s:
            best[key] = sample
    ex.close()
    return list(best.values())


def measure_executor(hardware: HardwareProfile) -> dict:
    """Time the probe models and fit; the figures keyed as the calibration stores them."""
    samples: list[StepSample] = []
    with tempfile.TemporaryDirectory(prefix="llmsched_calibrate_") as tmp:
        for layers in PROBE_LAYERS:
            folder = Path(tmp) / f"probe-{layers}"
            write_probe_model(folder, layers)
            samples.extend(time_decode_steps(folder, layers, hardware))
    fit = fit_host_costs(samples)
    return {
        "fit_rms_error": fit_rms_error(fit, samples),
        "step_overhead_s": fit.step_overhead_s,
        "layer_overhead_s": fit.layer_overhead_s,
        "request_overhead_s": fit.request_overhead_s,
        # None (no measurable KV cost): the profile falls back to the memory bandwidth.
        "decode_kv_bandwidth": fit.decode_kv_bandwidth if math.isfinite(fit.decode_kv_bandwidth) else None,
        "executor_samples": [[s.layers, s.decodes, s.kv_bytes, s.residual_s] for s in samples],
    }


def on_own_thread(fn: Callable[..., T], *args: object) -> T:
    """``fn(*args)`` on a thread that then exits, so its OpenMP team is gone before the probe's starts."""
    box: list[T] = []
    worker = threading.Thread(target=lambda: box.append(fn(*args)))
    worker.start()
    worker.join()
    if not box:
        raise RuntimeError(f"{getattr(fn, '__name__', fn)} failed on its thread")
    return box[0]


def main(argv: list[str] | None = None) -> int:
    """Child-process entry: read the microbenchmark figures as JSON on stdin, print the fit as JSON."""
    from llmsched.executor.sim.hardware import HardwareProfile

    figures = json.loads(sys.stdin.read())
    hw = HardwareProfile(
        name="cpu-probe",
        description="",
        peak_flops_bf16=figures["peak_flops"],
        peak_flops_fp8=None,
        mem_bandwidth=figures["mem_bandwidth"],
        mem_capacity=figures.get("mem_capacity", 16 << 30),
        link_bandwidth=figures["mem_bandwidth"] / 2,
        collective_latency_s=0.0,
        cuda_graphs=False,
        efficiency={"attention": figures["attention_efficiency"], "memory": figures["memory_efficiency"]},
        efficiency_curves=figures.get("efficiency_curves"),
    )
    # The matmul peak measured again here, before and after the probe, with
    # the executor's thread and allocator settings: the caller compares it
    # with its own microbenchmark, so a disturbance in either window, or a
    # library that dispatches differently in the executor's process, shows.
    from llmsched.sim.calibrate_torch import matmul_flops
    from llmsched.sim.settle import Limits, measure

    limits = Limits(**figures.get("limits", {}))
    n = figures.get("matmul_n", 1024)
    before = on_own_thread(measure, "probe_peak_flops_before", *matmul_flops(n), limits)
    out = measure_executor(hw)
    after = on_own_thread(measure, "probe_peak_flops_after", *matmul_flops(n), limits)
    out["readings"] = [before.to_dict(), after.to_dict()]
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
