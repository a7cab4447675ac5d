"""Multi-turn conversations: a streaming-input session vs re-sending the history.

Each of ``--sessions`` conversations runs ``--turns`` turns: a ``--history``
token first prompt, then per turn ``--input`` new tokens and ``--output``
generated ones. Turn i+1 is sent a think time after turn i's last token
(``--think`` seconds, fixed or exponential with that mean:
``--think-dist``; drawn from ``--seed``, the same for every mode); first
turns arrive together or at ``--session-rate`` per second. Three ways to
serve it, on the same simulated engine (``llmsched.sim.sessions``: the
cost-model executor on a virtual clock, ``--model`` on ``--hardware``) in
one run:

- ``session``: one resumable request per conversation; each new input
  resumes it with its KV resident (only the new tokens are computed);
- ``resend+prefix``: each turn a new request with the whole history, prefix
  caching on (the history is found in the cache up to the last full block);
- ``resend``: the same without prefix caching (the whole history recomputed).

Prints, per mode, the mean TTFT of each turn and the prompt tokens computed
beyond each turn's new input (recomputed history), and writes the figures
as JSON (``--json``).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "_common"))
from hostcpu import record_cpu

from llmsched.sim import DeploymentSpec, build_deployment
from llmsched.sim.sessions import SessionWorkload, simulate_sessions

# (name, session mode, prefix caching)
MODES = (("session", "session", True), ("resend+prefix", "resend", True), ("resend", "resend", False))


def run_mode(name: str, mode: str, caching: bool, args: argparse.Namespace, wl: SessionWorkload) -> dict:
    """Serve every conversation one way; TTFT and recomputed tokens per turn."""
    per_conv = wl.max_len() + 16
    dep = build_deployment(
        DeploymentSpec(
            model=args.model,
            hardware=args.hardware,
            max_model_len=per_conv,
            # Room for every conversation's whole history: the modes differ in compute, not capacity.
            num_gpu_blocks=1 + args.sessions * (-(-per_conv // 16)),
            max_num_batched_tokens=args.budget,
            max_num_seqs=args.sessions,
            enable_prefix_caching=caching,
            async_scheduling=args.async_scheduling,
        )
    )
    r = simulate_sessions(dep, wl, mode).summary()
    return {
        "mode": name,
        "ttft_ms_per_turn": [round(t["mean"], 2) for t in r["ttft_ms_per_turn"]],
        "p99_ttft_ms_per_turn": [round(t["p99"], 2) for t in r["ttft_ms_per_turn"]],
        "recomputed_tokens_per_turn": r["recomputed_tokens_per_turn"],
        "recomputed_tokens_total": sum(r["recomputed_tokens_per_turn"]),
        "sim_seconds": round(r["duration_s"], 3),
        "output_throughput": round(r["output_throughput"], 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sessions", type=int, default=32)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--history", type=int, default=2048, help="first prompt, tokens")
    ap.add_argument("--input", type=int, default=128, help="new tokens per later turn")
    ap.add_argument("--output", type=int, default=64, help="generated tokens per turn")
    ap.add_argument(
        "--think", type=float, default=2.0, help="seconds between a turn's end and the next input (mean)"
    )
    ap.add_argument("--think-dist", choices=["fixed", "exponential"], default="fixed")
    ap.add_argument(
        "--session-rate", type=float, default=math.inf, help="first turns per second (inf: at once)"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--budget", type=int, default=8192, help="max_num_batched_tokens")
    ap.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=False)
    ap.add_argument("--model", default="llama-3-8b")
    ap.add_argument("--hardware", default="h100")
    ap.add_argument("--json", default="sessions.json", help="where to write the figures")
    args = ap.parse_args()
    wl = SessionWorkload(
        num_sessions=args.sessions,
        turns=args.turns,
        first_input_len=args.history,
        input_len=args.input,
        output_len=args.output,
        think_time_s=args.think,
        think_dist=args.think_dist,
        session_rate=args.session_rate,
        seed=args.seed,
    )
    results = [run_mode(name, mode, caching, args, wl) for name, mode, caching in MODES]
    print(f"{wl.describe()}; {args.model} on {args.hardware} (simulated)")
    print(f"{'mode':<15} {'mean TTFT per turn (ms)':<50} recomputed tokens")
    for r in results:
        per_turn = " ".join(f"{x:7.1f}" for x in r["ttft_ms_per_turn"])
        print(f"{r['mode']:<15} {per_turn:<50} {r['recomputed_tokens_total']}")
    Path(args.json).write_text(
        json.dumps(record_cpu({"args": vars(args), "results": results}), indent=1) + "\n"
    )


if __name__ == "__main__":
    main()
