"""The server's startup log names the dtype chosen and the warm-up, both done before it serves."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmsched.engine.args import EngineArgs
from llmsched.executor.torch import device
from llmsched.server.args import ServerArgs
from llmsched.server.state import make_backend


@pytest.mark.parametrize(
    ("bf16_cpu", "line"),
    [
        (True, "dtype auto: checkpoint float32 -> bfloat16 (as vLLM does on CPU)"),
        (
            False,
            "dtype auto: checkpoint float32 kept (this CPU has no bfloat16 matmuls; vLLM would run bfloat16)",
        ),
    ],
)
def test_startup_log_says_how_dtype_auto_resolved_and_that_the_engine_warmed_up(
    use_embedded: Path, monkeypatch: pytest.MonkeyPatch, bf16_cpu: bool, line: str
) -> None:
    monkeypatch.setattr(device, "cpu_bf16_matmuls", lambda: bf16_cpu)
    args = EngineArgs(max_model_len=128, num_gpu_blocks_override=64, device="cpu")
    backend = make_backend(args, ServerArgs(engine_mode="thread"))
    try:
        log = backend.info().startup_log
        assert line in log
        # max_model_len 128: the greedy scratch prompt leaves room for its decode token.
        warm = [n for n in log if n.startswith("warm-up: 2 dummy steps (prefill of 127+8 tokens")]
        assert len(warm) == 1 and warm[0].endswith("before serving")
        ex = backend.engine.executor
        assert ex.warmup is not None
        assert str(ex.dtype) == ("torch.bfloat16" if bf16_cpu else "torch.float32")
    finally:
        backend.engine.close()
