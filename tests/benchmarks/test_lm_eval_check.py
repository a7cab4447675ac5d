"""benchmarks/serving/lm_eval_check.py, tiny: lm-eval through `llmsched serve` scores as its hf backend."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_local_completions_matches_the_hf_backend(smollm2_gguf: Path, tmp_path: Path) -> None:
    pytest.importorskip("lm_eval")
    out = tmp_path / "check.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    # A 16-token budget: every echoed prompt runs in several prefill chunks.
    script = ROOT / "benchmarks" / "serving" / "lm_eval_check.py"
    cmd = [sys.executable, str(script), "--out", str(out), "--limit", "2"]
    cmd += ["--serve-arg", "--max-num-batched-tokens 16"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["metrics_equal"]
    assert report["metrics"]["llmsched_serve"] == report["metrics"]["hf"]
    assert set(report["metrics"]["hf"]) == {"llmsched_mc_tiny", "llmsched_gen_tiny"}
    # 2 questions x 4 choices.
    assert report["num_loglikelihoods"] == 8
    assert report["max_abs_loglikelihood_diff"] <= 2e-3
    assert report["generation_mismatches"] == []
