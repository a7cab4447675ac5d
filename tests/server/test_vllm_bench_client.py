"""vLLM's own benchmark client (`vllm bench serve`) against the server, both backends, no route warnings.

Optional: it runs when LLMSCHED_VLLM_PYTHON names a Python that can run
``-m vllm.entrypoints.cli.main bench serve`` (a throwaway venv with vLLM
0.33; see the README), and is skipped otherwise.
"""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path

import pytest

from llmsched.engine.args import EngineArgs
from llmsched.server.args import ServerArgs
from llmsched.server.launch import ServerThread

VLLM_PYTHON = os.environ.get("LLMSCHED_VLLM_PYTHON")
pytestmark = pytest.mark.skipif(
    not VLLM_PYTHON, reason="LLMSCHED_VLLM_PYTHON is not set (a Python with vLLM 0.33's bench client)"
)
NUM_PROMPTS = 30


@pytest.fixture(scope="module")
def server(embedded_server: Callable[..., AbstractContextManager]) -> Iterator[ServerThread]:
    """The embedded model, served with its default name."""
    args = ServerArgs(log_level="warning")
    with embedded_server(EngineArgs(max_model_len=512, num_gpu_blocks_override=1024), args) as s:
        yield s


@pytest.mark.parametrize(
    ("backend", "endpoint"), [("openai", "/v1/completions"), ("openai-chat", "/v1/chat/completions")]
)
def test_vllm_bench_serve_runs_clean(server: ServerThread, backend: str, endpoint: str) -> None:
    model_dir = Path(server.state.model_root)
    cmd = [
        str(VLLM_PYTHON), "-m", "vllm.entrypoints.cli.main", "bench", "serve",
        "--backend", backend, "--base-url", server.base_url, "--endpoint", endpoint,
        "--model", server.state.model_name, "--tokenizer", str(model_dir),
        "--dataset-name", "random", "--random-input-len", "48", "--random-output-len", "8",
        "--num-prompts", str(NUM_PROMPTS), "--request-rate", "inf", "--temperature", "0",
    ]  # fmt: skip
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    log = run.stdout + run.stderr
    assert run.returncode == 0, log[-4000:]
    assert re.search(rf"Successful requests:\s+{NUM_PROMPTS}\b", log), log[-4000:]
    assert re.search(r"Failed requests:\s+0\b", log), log[-4000:]
    # The client probes /tokenize to align prompt lengths and warns when the route is missing.
    for warning in ("/tokenize unavailable", "/tokenize probe failed", "tokenizer mismatch", "404"):
        assert warning not in log, log[-4000:]
