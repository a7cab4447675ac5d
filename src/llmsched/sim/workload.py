"""Simulated workloads: when requests arrive and how long they are.

A workload is a few compact columns (arrival time, prompt and output
length, priority, prefix group), so a million requests cost a few tens of
MB; prompts are built only when a request arrives. Sources:

- synthetic (``synthetic_workload``): fixed or uniformly distributed lengths
  (vLLM's random dataset ``range_ratio``), all at once (rate ``inf``), at a
  fixed rate (``burstiness=inf``) or with gamma-distributed gaps (``burstiness``
  1 is Poisson; lower is burstier), optional shared-prefix groups and
  priority levels;
- a JSONL trace (``load_trace_workload``), one request per line.
"""

from __future__ import annotations

import json
import math
import random
import sys
from array import array
from dataclasses import dataclass, field
from pathlib import Path

from llmsched.core.errors import ConfigError
from llmsched.sim.images import ImagePlan, plan_images

# Synthetic prompts: a per-request marker token makes every prompt's first
# block (and so, through chained hashes, every later block) unique; groups
# share a prefix whose first token names the group. The values stay far
# apart so the two can never coincide.
_UNIQUE_BASE = 1_000_000
_GROUP_BASE = 500_000
_VOCAB = 30_000


def _filler(n: int) -> list[int]:
    return [100 + (j * 7919) % _VOCAB for j in range(n)]


@dataclass(slots=True)
class Workload:
    """Requests in arrival order, as columns; ``prompt(i)`` builds request i's tokens."""

    arrivals: array
    input_lens: array
    output_lens: array
    priorities: array | None = None
    # LoRA adapter id of each request (0: the base model); None: no adapters.
    loras: array | None = None
    # Shared-prefix group of each request (-1: none) and the prefix length.
    groups: array | None = None
    prefix_len: int = 0
    # Explicit prompts and ids (traces); None entries are synthesised.
    token_ids: list[list[int] | None] | None = None
    ids: list[str] | None = None
    # Each request's tenant (None: no tenants), for fair-share policies and per-tenant metrics.
    tenants: list[str | None] | None = None
    # Images of each request (vision-language models), or None.
    images: ImagePlan | None = None
    # Each request's line in its dataset file (None: the requests are in file order).
    file_index: array | None = None
    # How the arrivals were made, for reports.
    request_rate: float = math.inf
    burstiness: float = 1.0
    source: str = "synthetic"
    _filler: list[int] = field(default_factory=list, init=False, repr=False)
    _prefixes: dict[int, list[int]] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        n = len(self.arrivals)
        if n == 0:
            raise ConfigError("the workload has no requests")
        for name in ("input_lens", "output_lens", "priorities", "groups", "tenants", "loras", "file_index"):
            col = getattr(self, name)
            if col is not None and len(col) != n:
                raise ConfigError(f"workload column {name} has {len(col)} entries for {n} requests")

    def __len__(self) -> int:
        return len(self.arrivals)

    def request_id(self, i: int) -> str:
        """Request i's id (its index unless the trace named it)."""
        return self.ids[i] if self.ids is not None else str(i)

    def prompt(self, i: int) -> list[int]:
        """Request i's prompt token ids."""
        if self.token_ids is not None:
            explicit = self.token_ids[i]
            if explicit is not None:
                return explicit
        n = self.input_lens[i]
        filler = self._filler
        if len(filler) < n:
            filler = self._filler = _filler(max(n, 2 * len(filler)))
        g = self.groups[i] if self.groups is not None else -1
        if g < 0 or self.prefix_len <= 0:
            tokens = filler[:n]
            tokens[0] = _UNIQUE_BASE + i
        else:
            prefix = self._prefixes.get(g)
            if prefix is None:
                prefix = [_GROUP_BASE + g]
                prefix.extend(100 + (g * 131 + j * 7907) % _VOCAB for j in range(1, self.prefix_len))
                self._prefixes[g] = prefix
            if n <= self.prefix_len:
                tokens = prefix[:n]
            else:
                tokens = [*prefix, _UNIQUE_BASE + i, *filler[: n - self.prefix_len - 1]]
        if self.images is not None:
            self.images.place(i, tokens)
        return tokens

    def mm_items(self, i: int) -> tuple:
        """Request i's encoder inputs (images); empty without images."""
        if self.images is None:
            return ()
        return self.images.items(i, self.input_lens[i])

    @property
    def total_input_tokens(self) -> int:
        """Sum of prompt lengths."""
        return sum(self.input_lens)

    def describe(self) -> str:
        """One line: size, arrivals, lengths."""
        n = len(self)
        ins, outs = self.input_lens, self.output_lens
        if math.isinf(self.request_rate) and self.source == "synthetic":
            arr = "all at once"
        elif self.source == "synthetic":
            kind = "Poisson" if self.burstiness == 1.0 else f"gamma, burstiness {self.burstiness:g}"
            if math.isinf(self.burstiness):
                kind = "fixed interval"
            arr = f"{self.request_rate:g} req/s ({kind})"
        else:
            arr = f"from {self.source}, last arrival at {self.arrivals[-1]:.2f} s"
        lens = f"prompts {min(ins)}-{max(ins)} (mean {sum(ins) / n:.0f})"
        lens += f", outputs {min(outs)}-{max(outs)} (mean {sum(outs) / n:.0f}) tokens"
        if self.images is not None:
            lens += f", {self.images.describe()}"
        return f"{n} requests, {arr}, {lens}"


def arrival_times(
    n: int, request_rate: float, burstiness: float = 1.0, rng: random.Random | None = None
) -> array:
    """Arrival times in seconds with vLLM's benchmark semantics.

    Gaps are gamma distributed with shape ``burstiness`` and mean
    ``1 / request_rate`` (exponential when burstiness is 1); an infinite rate
    sends everything at time 0 and an infinite burstiness spaces requests
    exactly ``1 / request_rate`` apart. The times are then scaled so the last
    request arrives at ``n / request_rate``, as vLLM does, which keeps the
    offered load equal across seeds.
    """
    if not request_rate > 0:
        raise ConfigError(f"request_rate={request_rate} must be > 0 (inf sends everything at once)")
    if not burstiness > 0:
        raise ConfigError(f"burstiness={burstiness} must be > 0")
    out = array("d", bytes(8 * n))
    if math.isinf(request_rate):
        return out
    rng = rng or random.Random(0)
    t = 0.0
    if math.isinf(burstiness):
        gap = 1.0 / request_rate
        for i in range(n):
            t += gap
            out[i] = t
        return out
    if burstiness == 1.0:
        draw = rng.expovariate
        for i in range(n):
            t += draw(request_rate)
            out[i] = t
    else:
        gamma = rng.gammavariate
        theta = 1.0 / (request_rate * burstiness)
        for i in range(n):
            t += gamma(burstiness, theta)
            out[i] = t
    if t > 0:
        scale = (n / request_rate) / t
        for i in range(n):
            out[i] *= scale
    return out


def sample_lengths(n: int, mean: int, range_ratio: float, rng: random.Random, minimum: int = 1) -> array:
    """Integer lengths uniform in [floor(mean(1-r)), ceil(mean(1+r))], as vLLM's random dataset."""
    if not 0.0 <= range_ratio < 1.0:
        raise ConfigError(f"range_ratio={range_ratio} must be in [0, 1)")
    lo = max(math.floor(mean * (1 - range_ratio)), minimum)
    hi = max(math.ceil(mean * (1 + range_ratio)), lo)
    if lo == hi:
        return array("l", [lo]) * n
    draw = rng.randint
    return array("l", [draw(lo, hi) for _ in range(n)])


def synthetic_workload(
    num_prompts: int,
    input_len: int = 1024,
    output_len: int = 128,
    *,
    request_rate: float = math.inf,
    burstiness: float = 1.0,
    range_ratio: float = 0.0,
    prefix_len: int = 0,
    num_prefix_groups: int = 1,
    num_priority_levels: int = 1,
    num_loras: int = 0,
    seed: int = 0,
    images_per_request: int = 0,
    image_tokens: int = 576,
    image_range_ratio: float = 0.0,
    image_repeat: float = 0.0,
) -> Workload:
    """vLLM-random-dataset-like requests: total prompt = shared prefix + sampled input length.

    ``num_loras`` > 0 gives request i LoRA adapter ``i % num_loras + 1`` (no
    random draw, so the other columns stay those of the same seed).
    With ``images_per_request`` each prompt also holds that many images
    (``sim.images``) of about ``image_tokens`` embeddings, a share
    ``image_repeat`` of them repeating an earlier request's image.
    """
    if num_prompts < 1:
        raise ConfigError(f"num_prompts={num_prompts} must be >= 1")
    if input_len < 1 or output_len < 1:
        raise ConfigError(f"input_len={input_len} and output_len={output_len} must be >= 1")
    if prefix_len < 0 or num_prefix_groups < 1 or num_priority_levels < 1:
        raise ConfigError("prefix_len must be >= 0, num_prefix_groups and num_priority_levels >= 1")
    rng = random.Random(seed)
    arrivals = arrival_times(num_prompts, request_rate, burstiness, rng)
    ins = sample_lengths(num_prompts, input_len, range_ratio, rng)
    outs = sample_lengths(num_prompts, output_len, range_ratio, rng)
    groups = None
    if prefix_len:
        for i in range(num_prompts):
            ins[i] += prefix_len
        groups = array("l", [rng.randrange(num_prefix_groups) for _ in range(num_prompts)])
    prios = None
    if num_priority_levels > 1:
        prios = array("l", [rng.randrange(num_priority_levels) for _ in range(num_prompts)])
    if num_loras < 0:
        raise ConfigError(f"num_loras={num_loras} must be >= 0")
    loras = array("l", [i % num_loras + 1 for i in range(num_prompts)]) if num_loras else None
    images = None
    if images_per_request:
        images = plan_images(
            num_prompts,
            images_per_request,
            image_tokens,
            image_range_ratio,
            image_repeat,
            random.Random(seed + 1),
        )
        for i in range(num_prompts):
            # The images' positions come on top of the text, plus one text token after them.
            ins[i] += images.total_tokens(i) + 1
    return Workload(
        arrivals,
        ins,
        outs,
        priorities=prios,
        loras=loras,
        groups=groups,
        prefix_len=prefix_len,
        images=images,
        request_rate=request_rate,
        burstiness=burstiness,
    )


def _int_field(rec: dict, keys: tuple[str, ...], line: int, path: str) -> int | None:
    for k in keys:
        if k in rec and rec[k] is not None:
            v = rec[k]
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v != int(v):
                raise ConfigError(f"{path}:{line}: {k}={v!r} must be an integer")
            return int(v)
    return None


def load_trace_workload(
    path: str | Path,
    *,
    request_rate: float = math.inf,
    burstiness: float = 1.0,
    seed: int = 0,
    num_prompts: int | None = None,
) -> Workload:
    """Requests from a JSONL trace, one object per line.

    Keys: ``arrival_time`` (seconds; alias ``timestamp``), ``prompt_len``
    (alias ``input_len``) or ``prompt_token_ids``, ``output_len`` (alias
    ``max_tokens``), and optional ``priority``, ``tenant``, ``lora_id``, ``id``, ``prefix_group`` with
    ``shared_prefix_len``. Without arrival times the requests arrive as
    ``request_rate`` and ``burstiness`` say. Lines are sorted by arrival
    (stably); ``num_prompts`` keeps the first so many.
    """
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"dataset file {str(p)!r} does not exist")
    arrivals: list[float | None] = []
    ins: list[int] = []
    outs: list[int] = []
    prios: list[int] = []
    loras: list[int] = []
    groups: list[int] = []
    tokens: list[list[int] | None] = []
    ids: list[str] = []
    tenants: list[str | None] = []
    group_ids: dict[str, int] = {}
    prefix_len = 0
    with open(p) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            if num_prompts is not None and len(ins) >= num_prompts:
                break
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{p}:{lineno}: not valid JSON: {e}") from e
            if not isinstance(rec, dict):
                raise ConfigError(f"{p}:{lineno}: each line must be a JSON object")
            t = rec.get("arrival_time", rec.get("timestamp"))
            if t is not None and (not isinstance(t, (int, float)) or t < 0 or math.isnan(t)):
                raise ConfigError(f"{p}:{lineno}: arrival_time={t!r} must be a number >= 0")
            arrivals.append(None if t is None else float(t))
            toks = rec.get("prompt_token_ids")
            if toks is not None:
                if not isinstance(toks, list) or not toks or not all(isinstance(x, int) for x in toks):
                    raise ConfigError(f"{p}:{lineno}: prompt_token_ids must be a non-empty list of ints")
                n_in = len(toks)
            else:
                n_in = _int_field(rec, ("prompt_len", "input_len"), lineno, str(p))
                if n_in is None:
                    raise ConfigError(f"{p}:{lineno}: needs prompt_len (or input_len, or prompt_token_ids)")
            n_out = _int_field(rec, ("output_len", "max_tokens"), lineno, str(p))
            if n_out is None:
                raise ConfigError(f"{p}:{lineno}: needs output_len (or max_tokens)")
            if n_in < 1 or n_out < 1:
                raise ConfigError(f"{p}:{lineno}: prompt and output lengths must be >= 1")
            ins.append(n_in)
            outs.append(n_out)
            tokens.append(toks)
            ids.append(str(rec.get("id", len(ids))))
            prios.append(_int_field(rec, ("priority",), lineno, str(p)) or 0)
            tenant = rec.get("tenant")
            if tenant is not None and not isinstance(tenant, str):
                raise ConfigError(f"{p}:{lineno}: tenant={tenant!r} must be a string")
            tenants.append(sys.intern(tenant) if tenant is not None else None)
            lora = _int_field(rec, ("lora_id",), lineno, str(p)) or 0
            if lora < 0:
                raise ConfigError(f"{p}:{lineno}: lora_id={lora} must be >= 0 (0: the base model)")
            loras.append(lora)
            g = rec.get("prefix_group")
            if g is not None and toks is None:
                groups.append(group_ids.setdefault(str(g), len(group_ids)))
                k = _int_field(rec, ("shared_prefix_len",), lineno, str(p)) or 0
                if prefix_len and k and k != prefix_len:
                    raise ConfigError(f"{p}:{lineno}: shared_prefix_len must be the same on every line")
                prefix_len = prefix_len or k
            else:
                groups.append(-1)
    if not ins:
        raise ConfigError(f"dataset file {str(p)!r} has no requests")
    if len(set(ids)) != len(ids):
        raise ConfigError(f"dataset file {str(p)!r} repeats a request id")
    timed = [t is not None for t in arrivals]
    if any(timed) and not all(timed):
        raise ConfigError(f"{p}: either every line has an arrival_time or none does")
    if all(timed):
        order = sorted(range(len(ins)), key=lambda i: arrivals[i])
        times = array("d", [arrivals[i] for i in order])
        rate = math.inf
    else:
        order = list(range(len(ins)))
        times = arrival_times(len(ins), request_rate, burstiness, random.Random(seed))
        rate = request_rate
    has_tokens = any(t is not None for t in tokens)
    has_groups = any(g >= 0 for g in groups) and prefix_len > 0
    return Workload(
        times,
        array("l", [ins[i] for i in order]),
        array("l", [outs[i] for i in order]),
        priorities=array("l", [prios[i] for i in order]) if any(prios) else None,
        loras=array("l", [loras[i] for i in order]) if any(loras) else None,
        groups=array("l", [groups[i] for i in order]) if has_groups else None,
        prefix_len=prefix_len,
        token_ids=[tokens[i] for i in order] if has_tokens else None,
        ids=[ids[i] for i in order],
        tenants=[tenants[i] for i in order] if any(t is not None for t in tenants) else None,
        file_index=array("l", order) if order != sorted(order) else None,
        request_rate=rate,
        burstiness=burstiness,
        source=p.name,
    )
