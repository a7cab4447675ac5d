"""Multi-turn conversations: a streaming-input session vs re-sending the history.

Each of ``--sessions`` conversations runs ``--turns`` turns: a ``--history``
token first prompt, then per turn ``--input`` new tokens and ``--output``
generated ones, with ``--think`` seconds between a turn's end and the next
input. Three ways to serve it, on the same simulated engine (the cost-model
executor on a virtual clock, ``--model`` on ``--hardware``) in one run:

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
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from llmsched.core.config import SchedulerConfig
from llmsched.core.request import Request
from llmsched.core.sampling_params import SamplingParams
from llmsched.engine.engine_core import EngineCore
from llmsched.executor.sim import CostModel, SimExecutor, load_hardware, load_model

MODES = ("session", "resend+prefix", "resend")


def new_input(conv: int, turn: int, n: int) -> list[int]:
    """Token ids of one turn's input, distinct across conversations and turns."""
    base = 1000 + (conv * 97 + turn * 7919) % 20000
    return [base + j for j in range(n)]


def run_mode(mode: str, args: argparse.Namespace) -> dict:
    """Serve every conversation in ``mode``; TTFT and recomputed tokens per turn."""
    per_conv = args.history + args.turns * (args.input + args.output) + 16
    config = SchedulerConfig(
        num_gpu_blocks=1 + args.sessions * (-(-per_conv // 16)),
        max_model_len=per_conv,
        max_num_batched_tokens=args.budget,
        max_num_seqs=args.sessions,
        enable_prefix_caching=mode != "resend",
    )
    executor = SimExecutor(CostModel(load_model(args.model), load_hardware(args.hardware)))
    engine = EngineCore(config, executor)
    history = {c: new_input(c, 0, args.history) for c in range(args.sessions)}
    turn = dict.fromkeys(range(args.sessions), 0)
    started: dict[int, float] = {}
    first: dict[int, bool] = {}
    computed_prompt: dict[int, int] = {}
    ttft = [[] for _ in range(args.turns)]
    recomputed = [0] * args.turns
    # Arrivals: (time, conversation); the first turns arrive together.
    pending = [(0.0, c) for c in range(args.sessions)]

    def rid(c: int) -> str:
        return f"c{c}" if mode == "session" else f"c{c}-t{turn[c]}"

    def add(c: int, t: float) -> None:
        k = turn[c]
        params = SamplingParams(max_tokens=args.output, ignore_eos=True)
        if k == 0 or mode != "session":
            prompt = history[c] if k == 0 else history[c] + new_input(c, k, args.input)
            history[c] = prompt
            engine.add_request(Request(rid(c), prompt, params, resumable=mode == "session"))
        else:
            engine.add_request(Request(rid(c), new_input(c, k, args.input), params, resumable=True))
        started[c], first[c], computed_prompt[c] = t, False, 0

    owner = {}
    while pending or engine.has_requests():
        pending.sort()
        while pending and pending[0][0] <= executor.now:
            t, c = pending.pop(0)
            add(c, t)
            owner[rid(c)] = c
        if not engine.has_requests():
            executor.advance_to(pending[0][0])
            continue
        es = engine.step()
        if es is None:
            continue
        so = es.scheduler_output
        for req, n in zip(so.scheduled, so.num_scheduled_tokens):
            c = owner[req.request_id]
            if not first[c]:
                computed_prompt[c] += n
        for req in es.outputs.updated:
            c = owner[req.request_id]
            if not first[c]:
                first[c] = True
                k = turn[c]
                ttft[k].append(executor.now - started[c])
                new = args.history if k == 0 else args.input
                recomputed[k] += max(computed_prompt[c] - new - (k > 0), 0)
        for req in es.outputs.finished:
            c = owner[req.request_id]
            if mode != "session":
                history[c] = list(req.token_ids)
            turn[c] += 1
            if turn[c] < args.turns:
                pending.append((executor.now + args.think, c))
            elif mode == "session":
                # End of input: the waiting session is aborted, its blocks freed.
                engine.add_request(Request(rid(c), [1], SamplingParams(max_tokens=1)))
    return {
        "mode": mode,
        "ttft_ms_per_turn": [round(1000 * sum(x) / len(x), 2) for x in ttft],
        "recomputed_tokens_per_turn": recomputed,
        "recomputed_tokens_total": sum(recomputed),
        "sim_seconds": round(executor.now, 3),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sessions", type=int, default=32)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--history", type=int, default=2048, help="first prompt, tokens")
    ap.add_argument("--input", type=int, default=128, help="new tokens per later turn")
    ap.add_argument("--output", type=int, default=64, help="generated tokens per turn")
    ap.add_argument(
        "--think", type=float, default=2.0, help="seconds between a turn's end and the next input"
    )
    ap.add_argument("--budget", type=int, default=8192, help="max_num_batched_tokens")
    ap.add_argument("--model", default="llama-3-8b")
    ap.add_argument("--hardware", default="h100")
    ap.add_argument("--json", default="sessions.json", help="where to write the figures")
    args = ap.parse_args()
    results = [run_mode(m, args) for m in MODES]
    print(
        f"{args.sessions} conversations x {args.turns} turns, {args.history}-token history, "
        f"{args.input} in / {args.output} out per turn, {args.model} on {args.hardware} (simulated)"
    )
    print(f"{'mode':<15} {'TTFT per turn (ms)':<50} recomputed tokens")
    for r in results:
        per_turn = " ".join(f"{x:7.1f}" for x in r["ttft_ms_per_turn"])
        print(f"{r['mode']:<15} {per_turn:<50} {r['recomputed_tokens_total']}")
    Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
