#!/usr/bin/env python3
"""Record vLLM's own batch-limit defaults per device, world size and entry point into a JSON file.

Run with a Python that has vLLM installed (not llmsched's environment):

    /path/to/vllm-venv/bin/python tools/record_vllm_batch_defaults.py \\
        [--out tests/data/vllm_0_33_batch_defaults.json]

For each device below, vLLM's ``current_platform`` (as ``EngineArgs`` sees
it) is replaced by one that reports that device, and
``EngineArgs.get_batch_defaults(world_size)`` is called; an entry point
missing from its tables falls back to ``SchedulerConfig``'s defaults, as
``EngineArgs._set_default_max_num_seqs_and_batched_tokens_args`` does.
tests/engine/test_batch_defaults.py compares llmsched's table against the
file. The host's own platform is checked against its stand-in when it is
one of them (a CPU).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from unittest import mock

MiB = 1 << 20
GiB = 1 << 30
# (device, name, total memory in bytes as the driver reports it, compute capability 12.1, world size)
DEVICES = [
    ("cpu", "", 0, False, 1),
    ("cpu", "", 0, False, 2),
    ("cpu", "", 0, False, 4),
    ("cuda", "NVIDIA B200", 183359 * MiB, False, 1),
    ("cuda", "NVIDIA H200", 143771 * MiB, False, 1),
    ("cuda", "NVIDIA H100 80GB HBM3", 81559 * MiB, False, 1),
    ("cuda", "NVIDIA H100 80GB HBM3", 81559 * MiB, False, 8),
    ("cuda", "NVIDIA A100-SXM4-80GB", 81920 * MiB, False, 1),
    ("cuda", "NVIDIA L40S", 46068 * MiB, False, 1),
    ("cuda", "NVIDIA L4", 23034 * MiB, False, 1),
    ("cuda", "NVIDIA GB10", 120 * GiB, True, 1),
    # Around the memory thresholds (70 and 160 GiB).
    ("cuda", "NVIDIA test card", 70 * GiB - 1, False, 1),
    ("cuda", "NVIDIA test card", 70 * GiB, False, 1),
    ("cuda", "NVIDIA test card", 160 * GiB - 1, False, 1),
    ("cuda", "NVIDIA test card", 160 * GiB, False, 1),
]
USAGES = ("LLM_CLASS", "OPENAI_API_SERVER", "ENGINE_CONTEXT")


class StandIn:
    """A ``current_platform`` reporting one device (the calls get_batch_defaults makes)."""

    def __init__(self, device: str, name: str, memory: int, gb10: bool) -> None:
        self.device, self.name, self.memory, self.gb10 = device, name, memory, gb10

    def get_device_total_memory(self, device_id: int = 0) -> int:
        if self.device == "cpu":
            raise NotImplementedError("no device memory on CPU")
        return self.memory

    def get_device_name(self, device_id: int = 0) -> str:
        if self.device == "cpu":
            raise NotImplementedError("no device name on CPU")
        return self.name

    def is_device_capability(self, capability: object, device_id: int = 0) -> bool:
        return self.gb10 and tuple(capability) == (12, 1)  # type: ignore[arg-type]

    def is_tpu(self) -> bool:
        return False

    def is_cpu(self) -> bool:
        return self.device == "cpu"


def resolve(world_size: int) -> dict[str, tuple[int, int]]:
    """vLLM's (max_num_batched_tokens, max_num_seqs) per entry point for the patched platform."""
    from vllm.config import SchedulerConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.usage.usage_lib import UsageContext

    tokens, seqs = EngineArgs.get_batch_defaults(world_size)
    out = {}
    for usage in USAGES:
        ctx = UsageContext[usage]
        out[usage] = (
            tokens.get(ctx, SchedulerConfig.DEFAULT_MAX_NUM_BATCHED_TOKENS),
            seqs.get(ctx, SchedulerConfig.DEFAULT_MAX_NUM_SEQS),
        )
    return out


def main() -> int:
    """Call vLLM for each device and write the rows."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    default = Path(__file__).resolve().parents[1] / "tests/data/vllm_0_33_batch_defaults.json"
    p.add_argument("--out", type=Path, default=default)
    args = p.parse_args()
    import vllm
    import vllm.engine.arg_utils as arg_utils

    rows = []
    for device, name, memory, gb10, world_size in DEVICES:
        with mock.patch.object(arg_utils, "current_platform", StandIn(device, name, memory, gb10)):
            resolved = resolve(world_size)
        for usage, (tokens, seqs) in resolved.items():
            rows.append(
                {
                    "device": device,
                    "device_name": name,
                    "total_memory": memory,
                    "is_gb10": gb10,
                    "world_size": world_size,
                    "usage_context": usage,
                    "max_num_batched_tokens": tokens,
                    "max_num_seqs": seqs,
                }
            )
    if arg_utils.current_platform.is_cpu():
        # The stand-in for a CPU says what vLLM's own CPU platform says.
        with mock.patch.object(arg_utils, "current_platform", StandIn("cpu", "", 0, False)):
            stand_in = resolve(1)
        if resolve(1) != stand_in:
            sys.exit(f"the CPU stand-in disagrees with this host's platform: {stand_in} vs {resolve(1)}")
    record = {
        "vllm_version": vllm.__version__,
        "source": "vllm.engine.arg_utils.EngineArgs.get_batch_defaults, SchedulerConfig.DEFAULT_MAX_NUM_*",
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"vLLM {vllm.__version__}: {len(rows)} rows written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
