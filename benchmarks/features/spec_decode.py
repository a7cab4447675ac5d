#!/usr/bin/env python3
"""Speculative decoding against none, same run: output tok/s, acceptance rate, mean acceptance length.

Configurations: spec off, n-gram prompt lookup, and a draft model (by
default the target's first layers, a layer-truncated copy written to a
temporary folder, so it shares the tokenizer). Workloads:

* ``repeat``: prompts where lookup has something to find, as in code
  editing: a block of code followed by an instruction to rewrite it
  unchanged; greedy.
* ``random``: nothing to find: prompts of random token ids, sampled at
  temperature 1 (seeded), so drafts are rare and mostly rejected; this
  measures what speculation costs when it cannot help.

Batch 1 runs its prompts one at a time (max_num_seqs=1); batch 16 runs 16
prompts together. Each configuration has its own engine, warmed up by one
request; the configurations then alternate for ``--rounds`` rounds and each
reports its median round (the machine's load drifts between rounds).

    python benchmarks/features/spec_decode.py [--model DIR] [--batches 1,16] [--json results/spec_decode.json]
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "_common"))
from hostcpu import record_cpu  # noqa: E402

from llmsched import LLM, SamplingParams  # noqa: E402

CODE = [
    "def add(a, b):\n    return a + b\n\n\ndef mul(a, b):\n    return a * b\n\n\n"
    "def div(a, b):\n    if b == 0:\n        raise ValueError('b is zero')\n    return a / b\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, x):\n"
    "        self.items.append(x)\n\n    def pop(self):\n        return self.items.pop()\n",
    "for i in range(10):\n    if i % 2 == 0:\n        print(i, 'even')\n    else:\n        print(i, 'odd')\n"
    "total = sum(range(10))\nprint('total', total)\n",
    "import os\n\n\ndef list_files(path):\n    out = []\n    for name in os.listdir(path):\n"
    "        full = os.path.join(path, name)\n        if os.path.isfile(full):\n"
    "            out.append(full)\n    return out\n",
]


def truncated_copy(src: Path, layers: int, dst: Path) -> Path:
    """The model's first ``layers`` layers (plus embeddings, final norm, head) as a model folder."""
    from safetensors.torch import load_file, save_file

    dst.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((src / "config.json").read_text())
    cfg["num_hidden_layers"] = layers
    (dst / "config.json").write_text(json.dumps(cfg))
    for f in src.iterdir():
        if f.name not in ("config.json", "model.safetensors") and not f.name.startswith("llmsched_embedded"):
            shutil.copy(f, dst / f.name)
    w = load_file(src / "model.safetensors")
    keep = {k: v for k, v in w.items() if not k.startswith("model.layers.") or int(k.split(".")[2]) < layers}
    save_file(keep, dst / "model.safetensors")
    return dst


def workload(name: str, n: int, vocab: int, output_len: int, seed: int) -> tuple[list, list[SamplingParams]]:
    """(prompts, params) of one workload."""
    if name == "repeat":
        prompts = [
            CODE[i % len(CODE)] + f"\n# variant {i}\nRewrite the code above, unchanged:\n" for i in range(n)
        ]
        params = [SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True) for _ in range(n)]
        return prompts, params
    rng = random.Random(seed)
    prompts = [{"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(128)]} for _ in range(n)]
    params = [
        SamplingParams(temperature=1.0, max_tokens=output_len, ignore_eos=True, seed=seed + i)
        for i in range(n)
    ]
    return prompts, params


def measure(llm: LLM, prompts: list, params: list[SamplingParams], batch: int) -> dict:
    """Generate, in groups of ``batch``; output tokens per second and the spec-decode counters' change."""
    eng = llm.llm_engine
    spec0 = eng.spec_stats.as_tuple() if eng.spec_stats is not None else None
    steps0 = eng.num_steps
    out_tokens = 0
    t0 = time.perf_counter()
    for i in range(0, len(prompts), batch):
        outs = llm.generate(prompts[i : i + batch], params[i : i + batch], use_tqdm=False)
        out_tokens += sum(len(o.outputs[0].token_ids) for o in outs)
    dt = time.perf_counter() - t0
    row = {
        "output_tokens": out_tokens,
        "seconds": dt,
        "output_tok_s": out_tokens / dt,
        "steps": eng.num_steps - steps0,
    }
    if spec0 is not None:
        cur = eng.spec_stats.as_tuple()  # type: ignore[union-attr]
        d, toks, a = (cur[i] - spec0[i] for i in range(3))
        row["drafts"], row["draft_tokens"], row["accepted_tokens"] = d, toks, a
        row["acceptance_rate"] = a / toks if toks else 0.0
        row["mean_acceptance_length"] = 1 + a / d if d else 1.0
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="target model folder (default: the embedded demo model)")
    ap.add_argument(
        "--draft-model", default=None, help="draft model folder (default: the target's first layers)"
    )
    ap.add_argument(
        "--draft-layers", type=int, default=None, help="layers of the default draft (default: 1/4)"
    )
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens (default 4)")
    ap.add_argument("--lookup", default="2,4", help="prompt_lookup_min,max (default 2,4)")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--workloads", default="repeat,random")
    ap.add_argument("--configs", default="off,ngram,draft")
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--prompts-batch1", type=int, default=4, help="prompts run one at a time (default 4)")
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument(
        "--rounds", type=int, default=3, help="alternating rounds; the median is reported (default 3)"
    )
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    probe = LLM(args.model, max_num_seqs=1, max_model_len=args.max_model_len)
    model_dir = Path(probe.llm_engine.model_path)
    vocab = probe.llm_engine.vocab_size
    probe.close()
    lo, hi = (int(x) for x in args.lookup.split(","))
    tmp = Path(tempfile.mkdtemp(prefix="spec-draft-"))
    draft = args.draft_model
    if draft is None and "draft" in args.configs:
        layers = args.draft_layers or max(
            1, json.loads((model_dir / "config.json").read_text())["num_hidden_layers"] // 4
        )
        draft = str(truncated_copy(model_dir, layers, tmp / "draft"))
    configs = {
        "off": None,
        "ngram": {
            "method": "ngram",
            "num_speculative_tokens": args.k,
            "prompt_lookup_min": lo,
            "prompt_lookup_max": hi,
        },
        "draft": {"model": draft, "num_speculative_tokens": args.k},
    }
    names = args.configs.split(",")
    results = []
    try:
        for batch in (int(b) for b in args.batches.split(",")):
            n = args.prompts_batch1 if batch == 1 else batch
            for wl in args.workloads.split(","):
                prompts, params = workload(wl, n, vocab, args.output_len, seed=0)
                results.extend(_compare(args, configs, names, batch, wl, prompts, params))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print()
    print(_table(results))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        info = {"model": str(model_dir), "draft_model": draft, "k": args.k, "lookup": [lo, hi]}
        Path(args.json).write_text(json.dumps(record_cpu({"config": info, "results": results}), indent=1))


def _compare(
    args: argparse.Namespace,
    configs: dict,
    names: list[str],
    batch: int,
    wl: str,
    prompts: list,
    params: list[SamplingParams],
) -> list[dict]:
    """Every configuration on one workload: engines built once, rounds alternating, the median round kept."""
    llms = {}
    rows: dict[str, list[dict]] = {name: [] for name in names}
    try:
        for name in names:
            llms[name] = llm = LLM(
                args.model,
                speculative_config=configs[name],
                max_num_seqs=batch,
                max_model_len=args.max_model_len,
                max_num_batched_tokens=max(2048, batch),
            )
            llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
        for _ in range(args.rounds):
            for name in names:
                rows[name].append(measure(llms[name], prompts, params, batch))
    finally:
        for llm in llms.values():
            llm.close()
    out = []
    for name in names:
        runs = sorted(rows[name], key=lambda r: r["output_tok_s"])
        row = dict(runs[len(runs) // 2])
        row.update(
            batch=batch, workload=wl, config=name, rounds_tok_s=[r["output_tok_s"] for r in rows[name]]
        )
        print(_line(row), flush=True)
        out.append(row)
    return out


def _line(r: dict) -> str:
    acc = f" accept {r['acceptance_rate']:.2f} len {r['mean_acceptance_length']:.2f}" if "drafts" in r else ""
    return f"batch {r['batch']:>2} {r['workload']:<6} {r['config']:<5} {r['output_tok_s']:8.1f} tok/s{acc}"


def _table(results: list[dict]) -> str:
    """Each configuration's output tok/s as a ratio to spec off in the same batch and workload."""
    base = {(r["batch"], r["workload"]): r["output_tok_s"] for r in results if r["config"] == "off"}
    lines = [
        f"{'batch':>5} {'workload':<8} {'config':<6} {'tok/s':>8} {'vs off':>7} {'accept':>7} {'mean len':>8}"
    ]
    for r in results:
        b = base.get((r["batch"], r["workload"]))
        ratio = f"{r['output_tok_s'] / b:6.2f}x" if b else "      -"
        acc = (
            f"{r['acceptance_rate']:7.2f} {r['mean_acceptance_length']:8.2f}"
            if "drafts" in r
            else f"{'-':>7} {'-':>8}"
        )
        lines.append(
            f"{r['batch']:>5} {r['workload']:<8} {r['config']:<6} {r['output_tok_s']:8.1f} {ratio} {acc}"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
