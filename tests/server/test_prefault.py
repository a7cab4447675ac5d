"""The server writes its KV cache once at startup when asked, and says so in its startup log."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import pytest

from llmsched.engine.args import EngineArgs
from llmsched.server.args import ServerArgs
from llmsched.server.state import make_backend


@pytest.mark.parametrize("prefault", [True, False])
def test_startup_log_reports_the_prefault(use_embedded: Path, prefault: bool) -> None:
    args = EngineArgs(max_model_len=128, num_gpu_blocks_override=64)
    backend = make_backend(args, ServerArgs(engine_mode="thread", prefault_kv_cache=prefault))
    try:
        log = backend.info().startup_log
        assert "Defaulting max_num_seqs to 128 for OPENAI_API_SERVER usage context on cpu." in log
        assert any(line.startswith("KV cache prefaulted:") for line in log) is prefault
        # The embedded model is small: every usable CPU but one is left to it.
        threads = max(1, len(os.sched_getaffinity(0)) - 1)
        assert f"The model runs on {threads} torch CPU thread(s) (--num-threads)." in log
    finally:
        backend.engine.close()


def test_the_command_line_prefaults_by_default() -> None:
    p = argparse.ArgumentParser()
    ServerArgs.add_cli_args(p)
    assert ServerArgs.from_cli_args(p.parse_args([])).prefault_kv_cache is True
    assert ServerArgs.from_cli_args(p.parse_args(["--no-prefault-kv-cache"])).prefault_kv_cache is False
    assert ServerArgs().prefault_kv_cache is False
