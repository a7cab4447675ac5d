"""lm-evaluation-harness against `llmsched serve`: the same metrics as lm-eval's own `hf` backend.

Runs two local tasks (examples/lm_eval: a multiple-choice one scored by
loglikelihoods, which `local-completions` asks for with ``echo``,
``logprobs: 1``, ``max_tokens: 1``, and a ``generate_until`` one) twice on
the same float32 model folder: through `llmsched serve` with lm-eval's
``local-completions`` backend, and in-process with lm-eval's ``hf`` backend
(transformers). Prints both sets of metrics and the largest loglikelihood
difference, writes everything as JSON, and exits 1 when a metric differs,
a generation differs or a loglikelihood is further than --tolerance away.

The model is SmolLM2-135M-Instruct: the Q4_1 GGUF file llmsched's `chat`
fetches, written once as an ordinary HF folder (weights dequantized to
float32 by transformers), so both backends read the same folder. No network
is used once the GGUF file is in llmsched's cache.

    python benchmarks/serving/lm_eval_check.py --out lm_eval_check.json [--limit 4]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "_common"))
from hostcpu import record_cpu

ROOT = Path(__file__).resolve().parents[2]
TASK_DIR = ROOT / "examples" / "lm_eval"
TASKS = ["llmsched_mc_tiny", "llmsched_gen_tiny"]


def smollm2_folder(dest: Path | None = None) -> Path:
    """SmolLM2-135M-Instruct as a float32 HF folder (config, safetensors, tokenizer), built once."""
    from llmsched.engine.chat_model import ensure_chat_model

    gguf = ensure_chat_model()
    dest = dest or gguf.parent / "SmolLM2-135M-Instruct-f32-hf"
    if (dest / "model.safetensors").is_file():
        return dest
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with tempfile.TemporaryDirectory(prefix="smollm2-", dir=gguf.parent) as tmp:
        kw = {"gguf_file": gguf.name}
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), **kw)
        loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), dtype=torch.float32, **kw)
        # transformers will not save a GGUF-loaded model: copy its (dequantized) weights into a plain one.
        config = loaded.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.load_state_dict(loaded.state_dict())
        model.generation_config = loaded.generation_config
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        os.replace(tmp, dest)
        # TemporaryDirectory's cleanup finds nothing left at tmp.
        Path(tmp).mkdir()
    return dest


def task_dir(into: Path) -> Path:
    """The example task YAMLs with their data files made absolute (lm-eval may run from anywhere)."""
    for src in TASK_DIR.glob("*.yaml"):
        text = src.read_text().replace("examples/lm_eval/", f"{TASK_DIR}/")
        (into / src.name).write_text(text)
    return into


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve(folder: Path, extra: list[str]) -> Iterator[str]:
    """`llmsched serve` on ``folder`` in float32, in a subprocess; yields its base URL."""
    import httpx

    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cmd = [sys.executable, "-m", "llmsched.cli", "serve", str(folder), "--dtype", "float32"]
    cmd += ["--port", str(port), "--served-model-name", "smollm2", *extra]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"llmsched serve exited: {proc.stderr.read()[-2000:]}")  # type: ignore[union-attr]
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError("llmsched serve did not answer within 300 s")
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def run_lm_eval(model: str, model_args: dict, tasks_path: Path, limit: int | None) -> dict:
    """lm-eval's simple_evaluate on the example tasks; returns its results with the samples."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    return simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=TASKS,
        task_manager=TaskManager(include_path=str(tasks_path)),
        limit=limit,
        log_samples=True,
        batch_size=1,
    )


def _metrics(res: dict) -> dict:
    """task -> {metric: value} (the numbers only)."""
    return {
        task: {k: v for k, v in m.items() if isinstance(v, (int, float)) and k != "alias"}
        for task, m in res["results"].items()
    }


def _responses(res: dict) -> dict:
    """task -> [(doc_id, the model's raw answers)] in doc order."""
    return {
        task: [(s["doc_id"], s["resps"]) for s in sorted(samples, key=lambda s: s["doc_id"])]
        for task, samples in res["samples"].items()
    }


def compare(served: dict, hf: dict, tolerance: float) -> dict:
    """Metric and per-request differences between the two runs."""
    m_served, m_hf = _metrics(served), _metrics(hf)
    r_served, r_hf = _responses(served), _responses(hf)
    lls: list[tuple[float, float]] = []
    gen_mismatch: list[dict] = []
    for task in r_hf:
        for (doc, a), (_, b) in zip(r_served[task], r_hf[task]):
            for ra, rb in zip(a, b):
                va, vb = ra[0], rb[0]
                if isinstance(vb, (list, tuple)):
                    lls.append((float(va[0]), float(vb[0])))
                elif va != vb:
                    gen_mismatch.append({"task": task, "doc_id": doc, "served": va, "hf": vb})
    diffs = [abs(a - b) for a, b in lls]
    return {
        "metrics_equal": m_served == m_hf,
        "num_loglikelihoods": len(lls),
        "max_abs_loglikelihood_diff": max(diffs) if diffs else 0.0,
        "loglikelihoods_within_tolerance": all(d <= tolerance for d in diffs),
        "generation_mismatches": gen_mismatch,
        "loglikelihoods": [{"served": a, "hf": b} for a, b in lls],
    }


def main(argv: list[str] | None = None) -> int:
    """Run both backends, compare, print, write JSON; 0 when they agree."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("lm_eval_check.json"))
    ap.add_argument("--limit", type=int, default=None, help="documents per task (default: all)")
    ap.add_argument("--folder", type=Path, default=None, help="an HF model folder (default: SmolLM2, built)")
    ap.add_argument("--tolerance", type=float, default=2e-3)
    ap.add_argument(
        "--serve-arg", action="append", default=[], help="extra `llmsched serve` argument (repeatable)"
    )
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    folder = args.folder or smollm2_folder()
    with tempfile.TemporaryDirectory(prefix="lm-eval-tasks-") as tmp:
        tasks = task_dir(Path(tmp))
        t0 = time.monotonic()
        hf = run_lm_eval(
            "hf", {"pretrained": str(folder), "dtype": "float32", "device": "cpu"}, tasks, args.limit
        )
        t_hf = time.monotonic() - t0
        with serve(folder, [a for s in args.serve_arg for a in s.split()]) as url:
            served_args = {
                "model": "smollm2",
                "base_url": url + "/v1/completions",
                "tokenizer": str(folder),
                "tokenizer_backend": "huggingface",
                "tokenized_requests": True,
                "num_concurrent": 1,
                "max_retries": 1,
            }
            t0 = time.monotonic()
            served = run_lm_eval("local-completions", served_args, tasks, args.limit)
            t_served = time.monotonic() - t0
    report = {
        "model_folder": str(folder),
        "limit": args.limit,
        "tolerance": args.tolerance,
        "serve_args": args.serve_arg,
        "metrics": {"llmsched_serve": _metrics(served), "hf": _metrics(hf)},
        "seconds": {"llmsched_serve": round(t_served, 1), "hf": round(t_hf, 1)},
        **compare(served, hf, args.tolerance),
    }
    args.out.write_text(json.dumps(record_cpu(report), indent=2))
    for name in ("llmsched_serve", "hf"):
        print(f"{name:>15}: {json.dumps(report['metrics'][name])}")
    print(
        f"loglikelihoods: {report['num_loglikelihoods']},"
        f" max |diff| {report['max_abs_loglikelihood_diff']:.2e}"
        f" (tolerance {args.tolerance}); generation mismatches: {len(report['generation_mismatches'])};"
        f" metrics equal: {report['metrics_equal']}"
    )
    print(f"wrote {args.out}")
    ok = (
        report["metrics_equal"]
        and report["loglikelihoods_within_tolerance"]
        and not report["generation_mismatches"]
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
