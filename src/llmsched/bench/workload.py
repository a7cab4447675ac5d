"""The replay workload format (see REPLAY in the docs): parse, default, resolve."""

from __future__ import annotations

import json
import zlib
from dataclasses import dataclass
from pathlib import Path

from llmsched.bench.scripted_connector import KVScript
from llmsched.core.config import SchedulerConfig
from llmsched.core.connector import KVTransferConfig
from llmsched.core.errors import ConfigError
from llmsched.core.mm_item import MMItem

# Defaults of the workload format, as vLLM's reference driver applies them.
CONFIG_DEFAULTS: dict = {
    "max_num_batched_tokens": 8192,
    "max_num_seqs": 256,
    "max_model_len": None,
    "block_size": 16,
    "num_gpu_blocks": None,
    "enable_prefix_caching": True,
    "enable_chunked_prefill": True,
    "long_prefill_token_threshold": 0,
    "policy": "fcfs",
    "sample_token_id": 7,
    "scheduler_reserve_full_isl": True,
    "watermark": 0.0,
}
# Keys the reference driver understands that change no scheduling decision.
IGNORED_KEYS = {"log_stats", "gc_freeze", "use_v2_model_runner", "scheduler_extra", "cache_extra"}
_VOCAB = 32000


@dataclass(slots=True)
class WorkloadRequest:
    """One request of a workload."""

    request_id: str
    index: int
    arrival_step: int
    prompt_token_ids: list[int]
    max_tokens: int
    priority: int = 0
    sample_token_id: int | None = None
    lora_id: int = 0
    cache_salt: str | None = None
    tenant: str | None = None
    # What a scripted KV connector holds for it (workloads with a connector).
    kv: KVScript | None = None
    # A streaming-input session: later inputs (arrival step, prompt ids,
    # max_tokens) and the step its input ends (None: the last input's step).
    segments: list[tuple[int, list[int], int]] | None = None
    close_step: int | None = None
    # Scripted finishes (REPLAY_STOPS.md): the K-th sample is EOS / the stop token.
    eos_at: int | None = None
    stop_at: int | None = None
    # Scripted drafts (docs/replay_scripts.md): (offered, accepted) per step that returns tokens.
    spec: list[tuple[int, int]] | None = None
    # A structured-output request whose grammar compiles this many steps after arrival.
    grammar_steps: int | None = None

    @property
    def total_len(self) -> int:
        """The longest the request gets: prompt, outputs and every later input with its outputs."""
        return (
            len(self.prompt_token_ids) + self.max_tokens + sum(len(p) + m for _, p, m in self.segments or ())
        )

    # Encoder inputs (images): their placeholder positions and content hashes.
    mm: tuple[MMItem, ...] = ()


@dataclass(slots=True)
class Workload:
    """A parsed workload: raw config knobs (defaults applied) and requests."""

    config: dict
    requests: list[WorkloadRequest]
    # A scripted KV connector's role and failure policy, when the workload has one.
    kv_connector: KVTransferConfig | None = None

    @property
    def has_mm(self) -> bool:
        """True if any request carries encoder inputs."""
        return any(r.mm for r in self.requests)

    def scheduler_config(self, **overrides: object) -> SchedulerConfig:
        """The SchedulerConfig the workload asks for, with its nulls resolved."""
        cfg = {**self.config, **overrides}
        bs = int(cfg["block_size"])
        if cfg["max_model_len"] is None:
            cfg["max_model_len"] = max(r.total_len for r in self.requests)
        if cfg["num_gpu_blocks"] is None:
            # A hybrid model's Mamba group draws on the same pool: twice as many.
            cfg["num_gpu_blocks"] = 1 + sum(-(-r.total_len // bs) for r in self.requests) * (
                2 if cfg.get("mamba") else 1
            )
        cfg.pop("sample_token_id", None)
        return SchedulerConfig(**cfg)


def synth_prompt(req: dict, index: int) -> list[int]:
    """Prompt ids for a request given by ``prompt_len`` rather than explicit ids.

    Requests sharing a ``prefix_group`` share their first ``shared_prefix_len``
    tokens; the rest is unique to the request index. This is the reference
    driver's scheme, so prompt_len workloads replay identically in both.
    """
    n = int(req["prompt_len"])
    k = min(int(req.get("shared_prefix_len", 0)), n)
    tokens: list[int] = []
    if k:
        g = zlib.crc32(str(req.get("prefix_group", "default")).encode())
        tokens.extend(10 + (g + 7 * j) % (_VOCAB - 100) for j in range(k))
    base = (index * 131) % (_VOCAB - 200)
    tokens.extend(100 + base if j == 0 else 100 + (base + 1 + j) % (_VOCAB - 200) for j in range(n - k))
    return tokens


def parse_workload(data: dict) -> Workload:
    """Build a Workload from its JSON object, naming any invalid field."""
    if not isinstance(data, dict) or "requests" not in data:
        raise ConfigError("a workload is a JSON object with 'config' and 'requests'")
    raw = data.get("config") or {}
    if not isinstance(raw, dict):
        raise ConfigError("'config' must be an object of scheduler settings")
    known = set(CONFIG_DEFAULTS) | set(SchedulerConfig.field_names()) | {"kv_connector"}
    unknown = set(raw) - known - IGNORED_KEYS
    if unknown:
        raise ConfigError(f"unknown workload config keys: {sorted(unknown)}")
    config = {**CONFIG_DEFAULTS, **{k: v for k, v in raw.items() if k not in IGNORED_KEYS}}
    kv_connector = parse_kv_connector(config.pop("kv_connector", None))
    # The reference driver passes extra scheduler settings through
    # scheduler_extra; those we implement apply, others would change decisions.
    extra = raw.get("scheduler_extra") or {}
    unsupported = set(extra) - set(SchedulerConfig.field_names())
    if unsupported:
        raise ConfigError(f"unsupported scheduler_extra keys: {sorted(unsupported)}")
    config.update(extra)
    requests = []
    seen: set[str] = set()
    if not isinstance(data["requests"], list):
        raise ConfigError("'requests' must be a list of request objects")
    for i, r in enumerate(data["requests"]):
        if not isinstance(r, dict):
            raise ConfigError(f"request #{i} is {r!r}, not an object")
        rid = str(r.get("id", i))
        if rid in seen:
            raise ConfigError(f"request id {rid!r} appears twice in the workload")
        seen.add(rid)
        if "prompt_token_ids" in r:
            prompt = [int(t) for t in r["prompt_token_ids"]]
        elif "prompt_len" in r:
            prompt = synth_prompt(r, i)
        else:
            raise ConfigError(f"request {rid!r} has neither prompt_token_ids nor prompt_len")
        if "max_tokens" not in r:
            raise ConfigError(f"request {rid!r} has no max_tokens")
        kv = None
        if r.get("kv") is not None:
            if kv_connector is None:
                raise ConfigError(f"request {rid!r} has 'kv' but the workload config has no kv_connector")
            kv = KVScript.parse(rid, r["kv"])
        segments = parse_segments(rid, r, i, len(data["requests"]))
        requests.append(
            WorkloadRequest(
                request_id=rid,
                index=i,
                arrival_step=int(r.get("arrival_step", 0)),
                prompt_token_ids=prompt,
                max_tokens=int(r["max_tokens"]),
                priority=int(r.get("priority", 0)),
                sample_token_id=r.get("sample_token_id"),
                lora_id=int(r.get("lora_id", 0)),
                cache_salt=r.get("cache_salt"),
                tenant=_tenant(r, rid),
                kv=kv,
                segments=segments,
                close_step=None if r.get("close_step") is None else int(r["close_step"]),
                mm=parse_mm(rid, r.get("mm")),
                eos_at=_sample_index(r, rid, "eos_at"),
                stop_at=_sample_index(r, rid, "stop_at"),
                grammar_steps=_count(r, rid, "grammar_steps"),
                spec=parse_spec(rid, r.get("spec"), int(config.get("num_speculative_tokens") or 0)),
            )
        )
    if not requests:
        raise ConfigError("the workload has no requests")
    return Workload(config, requests, kv_connector)


def _sample_index(r: dict, rid: str, key: str) -> int | None:
    """A request's optional ``eos_at`` / ``stop_at``: which sample (from 1) ends it."""
    k = r.get(key)
    if k is None:
        return None
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ConfigError(f"request {rid!r}: {key} must be an integer >= 1 (the K-th sample), got {k!r}")
    return k


def _count(r: dict, rid: str, key: str) -> int | None:
    """A request's optional non-negative integer field ``key``."""
    k = r.get(key)
    if k is None:
        return None
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise ConfigError(f"request {rid!r}: {key} must be an integer >= 0, got {k!r}")
    return k


def parse_spec(rid: str, raw: object, num_speculative_tokens: int) -> list[tuple[int, int]] | None:
    """A request's ``spec`` script: [offered, accepted] per step that returns tokens, or None."""
    if raw is None:
        return None
    if not num_speculative_tokens:
        raise ConfigError(f"request {rid!r} has 'spec' but the workload config has no num_speculative_tokens")
    if not isinstance(raw, list):
        raise ConfigError(f"request {rid!r}: 'spec' must be a list of [offered, accepted] pairs")
    out = []
    for k, pair in enumerate(raw, 1):
        ok = isinstance(pair, list | tuple) and len(pair) == 2
        ok = ok and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in pair)
        if not ok or pair[0] > num_speculative_tokens:
            raise ConfigError(
                f"request {rid!r}: spec entry #{k} is {pair!r}; each is [offered, accepted] with "
                f"0 <= offered <= num_speculative_tokens ({num_speculative_tokens}) and accepted >= 0"
            )
        out.append((pair[0], pair[1]))
    return out


def _tenant(r: dict, rid: str) -> str | None:
    """A request's optional ``tenant`` (a string)."""
    t = r.get("tenant")
    if t is not None and not isinstance(t, str):
        raise ConfigError(f"request {rid!r}: tenant must be a string, got {t!r}")
    return t


def parse_segments(rid: str, r: dict, index: int, num_requests: int) -> list | None:
    """A session's later inputs: (arrival step, prompt ids, max_tokens) each, or None."""
    raw = r.get("segments")
    if not raw:
        if r.get("close_step") is not None:
            raise ConfigError(f"request {rid!r} has close_step but no segments")
        return None
    if not isinstance(raw, list):
        raise ConfigError(f"request {rid!r}: 'segments' must be a list of input objects")
    out = []
    for k, seg in enumerate(raw, 1):
        if not isinstance(seg, dict) or "arrival_step" not in seg or "max_tokens" not in seg:
            raise ConfigError(f"request {rid!r}: segment #{k} needs arrival_step and max_tokens")
        if "prompt_token_ids" in seg:
            prompt = [int(t) for t in seg["prompt_token_ids"]]
        elif "prompt_len" in seg:
            # The reference driver's index for a segment's synthetic prompt.
            prompt = synth_prompt(seg, num_requests * (k + 1) + index)
        else:
            raise ConfigError(f"request {rid!r}: segment #{k} has neither prompt_token_ids nor prompt_len")
        if not prompt:
            raise ConfigError(f"request {rid!r}: segment #{k} has an empty prompt")
        out.append((int(seg["arrival_step"]), prompt, int(seg["max_tokens"])))
    return out


def parse_mm(rid: str, raw: object) -> tuple[MMItem, ...]:
    """A request's ``mm`` list of encoder inputs.

    One id with two lengths is allowed, as vLLM allows it: the request that
    meets the other length in the encoder cache fails with an error.
    """
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise ConfigError(f"request {rid!r}: 'mm' must be a list of {{offset, length, id}} objects")
    items = []
    for k, m in enumerate(raw):
        if not isinstance(m, dict) or not {"offset", "length", "id"} <= set(m):
            raise ConfigError(f"request {rid!r}: mm item #{k} needs 'offset', 'length' and 'id', got {m!r}")
        items.append(
            MMItem(int(m["offset"]), int(m["length"]), str(m["id"]), str(m.get("modality", "image")))
        )
    return tuple(items)


def parse_kv_connector(raw: object) -> KVTransferConfig | None:
    """The ``kv_connector`` config knob: None, or {"role": ..., "load_failure_policy": ...}."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ConfigError(
            f"kv_connector must be an object with 'role' and 'load_failure_policy', got {raw!r}"
        )
    unknown = sorted(set(raw) - {"role", "load_failure_policy"})
    if unknown:
        raise ConfigError(f"kv_connector: unknown keys {unknown}; known: ['load_failure_policy', 'role']")
    return KVTransferConfig(**raw)


def load_workload(path: str | Path) -> Workload:
    """Read and parse a workload file."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"workload file {str(p)!r} does not exist")
    try:
        data = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"workload file {str(p)!r} is not valid JSON: {e}") from e
    try:
        return parse_workload(data)
    except (ConfigError, TypeError, ValueError) as e:
        raise ConfigError(f"workload file {str(p)!r}: {e}") from e
