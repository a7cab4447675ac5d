"""2,000-request step traces equal, byte for byte, those of the simulator before this version.

The digests were taken from traces written by ``llmsched simulate`` before plain
decode steps and the one simulation loop existed
(wall-clock fields ``schedule_ns`` and ``update_ns`` left out,
as is the header, which carries the version). The pressure trace's digest was
retaken when ``admitted`` began to list a step's admissions in vLLM's order (new
requests first, then resumed ones): its steps are otherwise unchanged, which was
checked by comparing every step with ``admitted`` sorted.
"""

from __future__ import annotations

import hashlib
import re

import pytest

from llmsched.cli import main

_WALL = re.compile(r',"schedule_ns":\d+,"update_ns":\d+')
GOLDEN = {
    # Poisson at 4 req/s, 1024/64 tokens, sync: mostly plain decode steps.
    "sync-4rps": (
        "--request-rate 4 --output-len 64 --no-async-scheduling",
        "ec0455b5d0bfc10fce596d75655132271d92996b5d317f3a248aa1ee45c0eb18",
    ),
    # KV pressure (preemptions), shared prefixes, varied outputs.
    "sync-pressure": (
        "--max-num-seqs 128 --request-rate 30 --output-len 256 --range-ratio 0.5 --no-async-scheduling "
        "--num-gpu-blocks 3000 --prefix-len 256 --num-prefix-groups 4",
        "7bf703c111e123a04dc25905bf3c29f9bc90384681a858977f9f2212cc45e6c3",
    ),
}


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_trace_of_2000_requests_is_unchanged(name, tmp_path, capsys):
    flags, digest = GOLDEN[name]
    trace = tmp_path / "trace.jsonl"
    # The roofline h100 the digests were recorded on (the fitted one prices steps differently).
    args = [
        "simulate",
        "--hardware",
        "h100-roofline",
        "--num-prompts",
        "2000",
        *flags.split(),
        "--disable-tqdm",
        "--trace",
        str(trace),
    ]
    assert main(args) == 0
    capsys.readouterr()
    h = hashlib.sha256()
    with open(trace) as f:
        next(f)
        for line in f:
            h.update(_WALL.sub("", line).encode())
    assert h.hexdigest() == digest
