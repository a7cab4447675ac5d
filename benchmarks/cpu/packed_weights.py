"""Would keeping a GGUF's 4-bit weights packed speed up CPU decode?

The torch executor dequantizes GGUF weights to bfloat16 at load time and runs
its linears on oneDNN-prepacked bfloat16 weights. The alternative is to keep
4-bit weights packed and dequantize inside each matmul: PyTorch's CPU kernel
``_weight_int4pack_mm_for_cpu`` takes 4-bit weights with a scale and an
offset per group of 32 inputs, which is exactly Q4_1's block layout
(dequantized value = scale * q + min, q in 0..15, so the kernel's
zero point is min + 8 * scale). Q8_0 has one scale per 32 inputs, which
PyTorch's ``_weight_int8pack_mm`` (one scale per output row) cannot express
exactly; it is timed here as the best case for 8-bit.

For SmolLM2-135M's linear shapes (per layer: qkv 576->960, o 576->576,
gate_up 576->3072, down 1536->576; 30 layers; the tied lm_head 576->49152)
at batch 1, 8 and 64, each form's time is the median of interleaved repeats
(so load drift hits all forms alike), summed into the linear time of one
decode step. Prints the table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "_common"))
from hostcpu import record_cpu

GROUP = 32
LAYERS = 30
# (name, in_features, out_features, count per step)
SHAPES = [
    ("qkv", 576, 960, LAYERS),
    ("o_proj", 576, 576, LAYERS),
    ("gate_up", 576, 3072, LAYERS),
    ("down", 1536, 576, LAYERS),
    ("lm_head", 576, 49152, 1),
]


def bf16_form(w: torch.Tensor):
    """oneDNN-prepacked bfloat16, as the executor runs today."""
    packed = torch.ops.mkldnn._reorder_linear_weight(w.to(torch.bfloat16))
    return lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


def int4_form(w: torch.Tensor):
    """Q4_1-shaped 4-bit weights (scale and min per 32 inputs), dequantized inside the matmul."""
    out_f, in_f = w.shape
    groups = w.float().reshape(out_f, in_f // GROUP, GROUP)
    lo, hi = groups.amin(-1), groups.amax(-1)
    scale = ((hi - lo) / 15).clamp_min(1e-8)
    q = ((groups - lo[..., None]) / scale[..., None]).round().clamp(0, 15).to(torch.int32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.reshape(out_f, in_f), 2)
    zero = lo + 8 * scale
    sz = torch.stack([scale.T, zero.T], -1).to(torch.bfloat16).contiguous()
    return lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, GROUP, sz)


def int8_form(w: torch.Tensor):
    """8-bit weights with one scale per output row (a per-channel stand-in for Q8_0)."""
    scale = w.float().abs().amax(1).clamp_min(1e-8) / 127
    q = (w.float() / scale[:, None]).round().clamp(-127, 127).to(torch.int8)
    s = scale.to(torch.bfloat16)
    return lambda x: torch.ops.aten._weight_int8pack_mm(x, q, s)


FORMS = {
    "bf16 (oneDNN prepacked)": bf16_form,
    "int4 packed (Q4_1 layout)": int4_form,
    "int8 packed": int8_form,
}


def time_call(fn, x: torch.Tensor, iters: int) -> float:
    """Mean seconds per call over ``iters`` calls."""
    fn(x)
    t0 = time.perf_counter()
    for _ in range(iters):
        fn(x)
    return (time.perf_counter() - t0) / iters


def measure(batch: int, repeats: int, seed: int) -> dict[str, dict[str, float]]:
    """Median seconds per call of every form for every shape at one batch size."""
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, dict[str, float]] = {}
    for name, in_f, out_f, _ in SHAPES:
        w = torch.randn(out_f, in_f, generator=gen) * 0.02
        x = torch.randn(batch, in_f, generator=gen).to(torch.bfloat16)
        fns = {form: make(w) for form, make in FORMS.items()}
        iters = max(3, int(2e-3 * 1e9 / (2 * batch * in_f * out_f + 1e6)))
        samples: dict[str, list[float]] = {form: [] for form in fns}
        for _ in range(repeats):
            for form, fn in fns.items():
                samples[form].append(time_call(fn, x, iters))
        out[name] = {form: statistics.median(s) for form, s in samples.items()}
    return out


def main(argv: list[str] | None = None) -> int:
    """Run the comparison and print a table per batch size."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,8,64", help="batch sizes (default: %(default)s)")
    ap.add_argument("--repeats", type=int, default=15, help="interleaved repeats per shape (default: 15)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--json", default="results/packed_weights.json", help="result file (default: %(default)s)"
    )
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    result = {"torch": torch.__version__, "threads": torch.get_num_threads(), "batches": {}}
    for batch in (int(b) for b in args.batches.split(",")):
        per_shape = measure(batch, args.repeats, args.seed)
        step = {form: sum(per_shape[n][form] * count for n, _, _, count in SHAPES) for form in FORMS}
        base = step["bf16 (oneDNN prepacked)"]
        print(f"batch {batch}: linear time of one SmolLM2 decode step")
        for form, seconds in step.items():
            print(f"  {form:28s} {seconds * 1e3:7.2f} ms  ({base / seconds:.2f}x bf16's speed)")
        result["batches"][str(batch)] = {"per_shape_s": per_shape, "step_s": step}
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record_cpu(result), indent=2))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
