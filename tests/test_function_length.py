"""Function length: a function should read as about one screen.

Every function under ``src/llmsched`` (methods and nested functions included) is measured from
its ``def`` line to its last line, docstring and comments counted. Those in ``llmsched.core`` stay
within CORE_LIMIT lines, all others within LIMIT. LONG lists the known exceptions, each with the
reason it is long; the list only shrinks: an entry that now fits its limit, or no longer exists,
fails the test until it is taken off.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
CORE_LIMIT = 60
LIMIT = 80

# "path under src/llmsched::qualified name": why it is still longer than its limit.
LONG: dict[str, str] = {
    # core (limit 60)
    "core/request.py::Request.__init__": "sets every attribute of a __slots__ class, one line each",
    "core/sampling_params.py::SamplingParams.__post_init__": "checks each field with its own message",
    "core/config.py::SchedulerConfig.__post_init__": "checks each setting with its own message",
    # everything else (limit 80)
    "sim/cli.py::add_simulate_parser": "argparse declarations, one add_argument per simulate option",
    "engine/args.py::EngineArgs.add_cli_args": "argparse declarations, one add_argument per engine option",
    "server/args.py::ServerArgs.add_cli_args": "argparse declarations, one add_argument per server option",
    "sim/cli.py::run_simulate": "the simulate command end to end: deployment, workload, run, report",
    "sim/workload.py::load_trace_workload": "reads and checks every field of a JSONL trace line in one pass",
    "bench/throughput.py::run_throughput": "the offline bench loop and its latency and throughput summary",
    "executor/torch/input_batch.py::InputBatch.prepare": "flattens a step's chunks into input tensors",
    "sim/deployment.py::_build": "sizes a deployment: parallelism, memory plan and cost model together",
    "sim/runner.py::simulate": "the simulator's main loop over arrivals, steps and data-parallel ranks",
    "bench/replay.py::replay": "the replay loop: arrivals, steps, fabricated tokens and trace records",
    "engine/dp/bench.py::run_dp_throughput": "starts rank processes, runs them and merges their results",
    "executor/sim/memory.py::plan_memory": "KV sizing with an error per way it fails",
    "executor/sim/cost_model.py::CostModel._ops": "one table of every op's flops, bytes and communication",
    "engine/llm_engine.py::LLMEngine.add_request": "checks and forks: prompt, LoRA, grammar, media",
    "executor/torch/executor.py::TorchExecutor._load": "loads weights, KV cache, model and sampler in order",
    "engine/dp/proc_transport.py::ProcessTransport.__init__": "starts the listener and the rank processes",
    "bench/serve_cli.py::run_bench_serve": "the serving bench command end to end",
    "bench/cli.py::run_bench_throughput": "the throughput bench command end to end",
    "server/openai_routes.py::openai_router": "declares every OpenAI route as a nested function",
    "engine/llm.py::LLM.generate": "the offline generate loop with its error and session handling",
    "engine/llm_engine.py::LLMEngine.step": "one engine step: schedule, execute, update, detokenize, outputs",
    "sim/calibrate_executor.py::time_decode_steps": "times every probe batch on the torch executor",
    "engine/llm_engine.py::LLMEngine.__init__": "builds scheduler, executor and front end",
}


def function_lengths(src: Path = SRC) -> dict[str, int]:
    """Lines of every function under ``src/llmsched``, keyed ``path::qualified.name`` (path from there)."""
    lengths: dict[str, int] = {}
    pkg = src / "llmsched"
    for path in sorted(pkg.rglob("*.py")):
        rel = path.relative_to(pkg).as_posix()

        def visit(node: ast.AST, prefix: str, rel: str = rel) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    name = f"{prefix}{child.name}"
                    if not isinstance(child, ast.ClassDef):
                        key = f"{rel}::{name}"
                        n = child.end_lineno - child.lineno + 1  # type: ignore[operator]
                        # A redefinition (a property's setter) keeps the longest.
                        lengths[key] = max(n, lengths.get(key, 0))
                    visit(child, f"{name}.")
                else:
                    visit(child, prefix)

        visit(ast.parse(path.read_text(), str(path)), "")
    return lengths


def limit_for(key: str) -> int:
    """CORE_LIMIT in ``llmsched/core``, else LIMIT."""
    return CORE_LIMIT if key.startswith("core/") else LIMIT


def test_no_function_is_over_its_limit_unless_listed() -> None:
    lengths = function_lengths()
    too_long = {k: n for k, n in lengths.items() if n > limit_for(k) and k not in LONG}
    assert not too_long, (
        "over the limit (core 60 lines, elsewhere 80); split them, or list them in LONG with a reason: "
        + ", ".join(f"{k} ({n} lines)" for k, n in sorted(too_long.items(), key=lambda kv: -kv[1]))
    )


def test_every_listed_exception_is_still_over_its_limit() -> None:
    lengths = function_lengths()
    stale = sorted(k for k in LONG if lengths.get(k, 0) <= limit_for(k))
    assert not stale, f"now within the limit or gone; take them off LONG: {', '.join(stale)}"


def test_every_listed_exception_has_a_one_line_reason() -> None:
    for key, reason in LONG.items():
        assert reason.strip() and "\n" not in reason, f"{key}: give a one-line reason"


def test_lengths_cover_methods_and_nested_functions(tmp_path: Path) -> None:
    pkg = tmp_path / "llmsched" / "core"
    pkg.mkdir(parents=True)
    (pkg / "mod.py").write_text(
        "def short():\n    return 1\n\n\n"
        "class C:\n    def method(self):\n        def inner():\n            pass\n\n        return inner\n"
    )
    lengths = function_lengths(tmp_path)
    assert lengths == {
        "core/mod.py::short": 2,
        "core/mod.py::C.method": 5,
        "core/mod.py::C.method.inner": 2,
    }
    assert limit_for("core/mod.py::short") == CORE_LIMIT
    assert limit_for("sim/cli.py::run_simulate") == LIMIT
