"""llmsched's extras from vLLM's own configuration: ``additional_config["llmsched"]``.

``vllm serve ... --additional-config '{"llmsched": {"policy": "fair",
"policy_config": {...}, "tenant_key": "tenant", "trace": "steps.jsonl"}}'``:
the scheduling policy and its knobs, the ``SamplingParams.extra_args`` key
that names a request's tenant, and a file the per-step decision records
(with reasons) are appended to as JSON lines.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import IO, Any

from llmsched.core.config import SchedulerConfig
from llmsched.core.trace import StepTrace
from llmsched.integrations.vllm.checks import UnsupportedByLlmsched

KEYS = ("policy", "policy_config", "tenant_key", "trace")


class TraceWriter:
    """Appends one JSON line per step: what ran, and why each request got what it got."""

    def __init__(self, path: str) -> None:
        self._file: IO[str] = open(path, "a", encoding="utf-8")  # noqa: SIM115 - held for the engine's life

    def write(self, trace: StepTrace) -> None:
        """One step's record (the ``why`` field of ``llmsched replay --trace``)."""
        self._file.write(
            json.dumps({"step": trace.step, "why": trace.to_json()}, separators=(",", ":")) + "\n"
        )
        self._file.flush()

    def close(self) -> None:
        """Close the file."""
        self._file.close()


@dataclass
class Extras:
    """What ``additional_config["llmsched"]`` asks for (all optional)."""

    policy: str | None = None
    policy_config: dict | None = None
    tenant_key: str | None = None
    trace_path: str | None = None
    trace: TraceWriter | None = None

    @classmethod
    def from_vllm_config(cls, vllm_config: Any) -> Extras:
        """Read and check ``additional_config["llmsched"]``; opens the trace file if named."""
        raw = (getattr(vllm_config, "additional_config", None) or {}).get("llmsched") or {}
        if not isinstance(raw, dict):
            raise UnsupportedByLlmsched(f'additional_config["llmsched"] must be a JSON object, got {raw!r}')
        unknown = sorted(set(raw) - set(KEYS))
        if unknown:
            raise UnsupportedByLlmsched(
                f'additional_config["llmsched"] has unknown keys {unknown}; known: {", ".join(KEYS)}'
            )
        extras = cls(raw.get("policy"), raw.get("policy_config"), raw.get("tenant_key"), raw.get("trace"))
        if extras.policy is not None:
            # Validates the name and the knobs now, with the config's own messages.
            SchedulerConfig(
                num_gpu_blocks=2, max_model_len=1, policy=extras.policy, policy_config=extras.policy_config
            )
        if extras.tenant_key is not None and not isinstance(extras.tenant_key, str):
            raise UnsupportedByLlmsched('additional_config["llmsched"]["tenant_key"] must be a string')
        if extras.trace_path is not None:
            extras.trace = TraceWriter(str(extras.trace_path))
        return extras

    def tenant_of(self, request: Any) -> str | None:
        """The request's tenant: ``sampling_params.extra_args[tenant_key]`` when configured."""
        if self.tenant_key is None:
            return None
        extra = getattr(request.sampling_params, "extra_args", None) or {}
        value = extra.get(self.tenant_key)
        return None if value is None else str(value)

    def close(self) -> None:
        """Close the trace file, if open."""
        if self.trace is not None:
            self.trace.close()
            self.trace = None
