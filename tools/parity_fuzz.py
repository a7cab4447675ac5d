#!/usr/bin/env python3
"""Differential fuzzing of llmsched's compatible mode against vLLM's own V1 scheduler.

Generates random workloads in the replay format (REPLAY.md) with random knob
mixes, records what vLLM 0.33's real scheduler does with each (through the
reference driver ``drive_vllm.py``, run by a separate Python that has vLLM),
replays them through llmsched and compares every step: the decisions by
``llmsched.bench.parity.compare`` (sched lists in order, preempted and
finished sets), then step numbers, queue sizes, KV usage and prefix hits.
Where vLLM frees several requests' blocks in one step by iterating a set
(same-step KV senders, several failed loads under the "fail" policy), the
block ids it hands out afterwards change with Python's string hashing: if
they differ, the steps after the first such free compare which requests got
how many blocks (tagged ``order:block_ids_after_set_order_free``).
Failing workloads are saved (and with ``--shrink`` shrunk) for reproduction.
A development tool: the test suite never needs vLLM; it only replays the
corpus this tool writes (tests/data/parity_fuzz, see the README there).

Run from the repository root with the project's virtualenv::

    # fuzz 1000 random workloads (the default command is fuzz)
    .venv/bin/python tools/parity_fuzz.py --seed 1 --count 1000 --shrink --out /tmp/parity_fuzz

    # only workloads aimed at preemptions in the middle of a step
    .venv/bin/python tools/parity_fuzz.py fuzz --seed 2 --count 3000 --profile preempt --jobs 2

    # async scheduling only (vLLM's AsyncScheduler, REPLAY_ASYNC.md); --mode mixed draws both
    .venv/bin/python tools/parity_fuzz.py fuzz --seed 3 --count 10000 --mode async --jobs 2

    # with a scripted KV connector (REPLAY_PD.md): random roles, hits, delays, failures
    .venv/bin/python tools/parity_fuzz.py fuzz --seed 4 --count 1000 --mode mixed --connector on

    # with per-request scripts (docs/replay_scripts.md): drafts, grammar waits,
    # LoRA adapters over max_loras, EOS / stop finishes; mixed with priority
    .venv/bin/python tools/parity_fuzz.py fuzz --seed 5 --count 1000 --mode mixed --scripts on

    # re-check saved or hand-written workloads
    .venv/bin/python tools/parity_fuzz.py check /tmp/parity_fuzz/fail-*/shrunk/workload.json

    # record the vLLM traces of corpus files again, in place (new driver fields)
    .venv/bin/python tools/parity_fuzz.py rerecord tests/data/parity_fuzz/corpus-hybrid.jsonl.gz

    # rebuild the regression corpus (exact commands: tests/data/parity_fuzz/README.md)
    .venv/bin/python tools/parity_fuzz.py corpus --seed 2024 --profile small --count 2000 \
        --size 300 --out tests/data/parity_fuzz/corpus-small.jsonl.gz

Every command takes ``--ref-python`` (default /work/vllm-ref-venv/bin/python)
and ``--driver`` (default ../shared/vllm_ref/drive_vllm.py relative to the
repository). Each vLLM worker imports vLLM once (~15 s), then drives workload
after workload in-process through the driver's own main(); a mismatch is
confirmed with a fresh driver process before it is reported, so state left in
a worker cannot fake one. Exit status: 1 if any mismatch was found.

Besides knob values, every case is tagged with the llmsched decision paths it
walked (``path:*``: preempting a request already scheduled this step, several
victims for one allocation, admission refused by the watermark or by the
full-prompt reservation, duplicate block hashes, eviction, ...), recorded by
thin call-through wrappers, so coverage is measured rather than assumed.
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import io
import itertools
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from llmsched.bench.parity import compare, finish_order_is_deterministic  # noqa: E402
from llmsched.bench.replay import replay  # noqa: E402
from llmsched.bench.workload import parse_workload, synth_prompt  # noqa: E402
from llmsched.core.errors import ConfigError, InvalidSamplingParams, RequestRejected  # noqa: E402

# Errors llmsched raises for workloads it refuses.
REJECTED = (ConfigError, RequestRejected, InvalidSamplingParams)
DEFAULT_REF_PYTHON = "/work/vllm-ref-venv/bin/python"
# The project's copy of the reference driver: it also records vLLM's preemption order and block ids.
DEFAULT_DRIVER = str(REPO / "tools" / "drive_vllm.py")
MAX_STEPS = 100_000
# With a scripted KV connector some scripts never finish, in vLLM as here (a
# failed async load retried asynchronously reserves blocks against itself):
# runs stop sooner. Two runs cut off alike are compared on the steps both
# made, but never count as agreeing: the cut is reported as a difference.
MAX_STEPS_CONNECTOR = 3000


def max_steps_for(workload: dict) -> int:
    """The step cap of both runs of a workload."""
    return MAX_STEPS_CONNECTOR if workload["config"].get("kv_connector") else MAX_STEPS


# Per-step fields checked beyond the decisions; "admitted" carries the prefix hits.
BOOKKEEPING = ("step", "total_tokens", "num_running", "num_waiting", "kv_usage")
# Knobs of the resolved config that both sides report and must agree on.
RESOLVED_KEYS = (
    "max_num_batched_tokens",
    "max_num_seqs",
    "max_model_len",
    "enable_chunked_prefill",
    "long_prefill_token_threshold",
    "policy",
    "scheduler_reserve_full_isl",
    "watermark",
    "block_size",
    "num_gpu_blocks",
    "enable_prefix_caching",
    "async_scheduling",
)

# Runs inside the vLLM interpreter: loads the driver once and serves jobs
# (one JSON line each on stdin) so that vLLM's ~15 s of imports is paid once.
WORKER_CODE = r"""
import contextlib, importlib.util, io, json, os, sys, traceback
driver = sys.argv[1]
sys.path.insert(0, os.path.dirname(driver))  # the driver imports scripted_connector beside it
proto = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)  # stray prints from vLLM must not corrupt the protocol stream
spec = importlib.util.spec_from_file_location("drive_vllm", driver)
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
mod.DEFAULTS["gc_freeze"] = False  # freezing the heap on every run only piles up memory

class _Exit(Exception):
    pass

def _fake_exit(code=0):
    raise _Exit(code)

os._exit = _fake_exit
proto.write(json.dumps({"ready": True}) + "\n"); proto.flush()
for line in sys.stdin:
    job = json.loads(line)
    sys.argv = ["drive_vllm.py", job["workload"], job["trace"], "--max-steps", str(job["max_steps"])]
    res = {"ok": True}
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            mod.main()
    except _Exit:
        pass
    except BaseException as e:
        res = {"ok": False, "error": f"{type(e).__name__}: {e}",
               "traceback": traceback.format_exc()[-3000:]}
    proto.write(json.dumps(res) + "\n"); proto.flush()
"""


# ---- the reference side --------------------------------------------------------


class RefError(Exception):
    """vLLM refused or crashed on a workload."""


class RefWorker:
    """One long-lived vLLM interpreter that runs the driver on workload after workload."""

    def __init__(self, ref_python: str, driver: str) -> None:
        self.tmp = tempfile.mkdtemp(prefix="parity_fuzz_ref_")
        # Open for the worker's whole life (closed in close()); vLLM's logs go there.
        self.log = open(os.path.join(self.tmp, "stderr.log"), "w")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [ref_python, "-c", WORKER_CODE, driver],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
        )
        self.lock = threading.Lock()
        self._read()

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"vLLM worker died; see {self.log.name}")
        return json.loads(line)

    def run(self, workload: dict, max_steps: int | None = None) -> tuple[dict, list[dict]]:
        """(header, step records) of vLLM's trace for ``workload``."""
        if max_steps is None:
            max_steps = max_steps_for(workload)
        with self.lock:
            wpath = os.path.join(self.tmp, "w.json")
            tpath = os.path.join(self.tmp, "t.jsonl")
            Path(wpath).write_text(json.dumps(workload))
            job = {"workload": wpath, "trace": tpath, "max_steps": max_steps}
            self.proc.stdin.write(json.dumps(job) + "\n")
            self.proc.stdin.flush()
            res = self._read()
            if not res["ok"]:
                raise RefError(res["error"])
            return read_trace(Path(tpath).read_text())

    def close(self) -> None:
        """Stop the worker."""
        with contextlib.suppress(Exception):
            self.proc.stdin.close()
            self.proc.wait(timeout=30)
        self.log.close()
        shutil.rmtree(self.tmp, ignore_errors=True)


def read_trace(text: str) -> tuple[dict, list[dict]]:
    """Split a JSONL trace into its header and step records."""
    header: dict = {}
    steps = []
    for line in text.splitlines():
        if line.strip():
            rec = json.loads(line)
            if "header" in rec:
                header = rec["header"]
            else:
                steps.append(rec)
    return header, steps


def run_ref_fresh(ref_python: str, driver: str, workload: dict) -> tuple[dict, list[dict]]:
    """vLLM's trace from a brand-new driver process (slow; used to confirm mismatches)."""
    with tempfile.TemporaryDirectory(prefix="parity_fuzz_fresh_") as d:
        w, t = os.path.join(d, "w.json"), os.path.join(d, "t.jsonl")
        Path(w).write_text(json.dumps(workload))
        p = subprocess.run(
            [ref_python, driver, w, t, "--max-steps", str(max_steps_for(workload))],
            capture_output=True,
            text=True,
        )
        if p.returncode != 0:
            raise RefError(p.stderr[-2000:])
        return read_trace(Path(t).read_text())


class RefPool:
    """A fixed set of RefWorkers, handed out one per job."""

    def __init__(self, n: int, ref_python: str, driver: str) -> None:
        self.ref_python, self.driver = ref_python, driver
        with ThreadPoolExecutor(n) as ex:
            self.workers = list(ex.map(lambda _: RefWorker(ref_python, driver), range(n)))
        self._free = list(self.workers)
        self._cv = threading.Condition()

    @contextlib.contextmanager
    def worker(self) -> Iterator[RefWorker]:
        """Borrow a worker."""
        with self._cv:
            while not self._free:
                self._cv.wait()
            w = self._free.pop()
        try:
            yield w
        finally:
            with self._cv:
                self._free.append(w)
                self._cv.notify()

    def run(self, workload: dict) -> tuple[dict, list[dict]]:
        """vLLM's (header, steps) for ``workload`` on any free worker."""
        with self.worker() as w:
            return w.run(workload)

    def close(self) -> None:
        """Stop every worker."""
        for w in self.workers:
            w.close()


# ---- the llmsched side and the comparison ------------------------------------


# Code paths a replay took, recorded by thin wrappers around a few llmsched
# internals (they call straight through and change nothing). Per thread, as
# several replays run at once.
_PROBE = threading.local()


def _hit(name: str) -> None:
    hits = getattr(_PROBE, "hits", None)
    if hits is not None:
        hits.add(name)


def _install_probes() -> None:
    """Wrap llmsched internals so that a replay reports which decision paths it exercised."""
    from llmsched.core.kv.block_pool import BlockPool
    from llmsched.core.kv.manager import KVCacheManager
    from llmsched.core.scheduler import Scheduler

    schedule, unschedule, preempt = Scheduler.schedule, Scheduler._unschedule, Scheduler._preempt
    remove_stopped = Scheduler._remove_stopped
    aligned_chunk = Scheduler._aligned_chunk
    from llmsched.core.request import RequestStatus
    from llmsched.core.session import Sessions

    resume, add_input = Sessions.resume, Sessions.add_input
    cache_block, uncache, touch = BlockPool.cache_block, BlockPool._uncache, BlockPool.touch
    allocate_slots, allocate_new = KVCacheManager.allocate_slots, KVCacheManager.allocate_new

    def p_schedule(self, *args, **kwargs):
        _PROBE.allocating = None  # victims are counted per request within one step
        # The threshold only applies while more than one request is in the engine.
        _PROBE.threshold_on = len(self.running) + len(self.waiting) + len(self.holding) > 1
        for r in self.running:
            p = r.num_output_placeholders
            if p and r.num_computed_tokens + 2 - p >= r.num_prompt_tokens + r.max_tokens:
                _hit("path:async_max_tokens_in_flight")
                break
        return schedule(self, *args, **kwargs)

    def p_aligned_chunk(self, req, start, n):
        out = aligned_chunk(self, req, start, n)
        _hit("path:mamba_chunk_cut" if 0 < out < n else "path:mamba_skip" if out == 0 else "path:mamba_uncut")
        return out

    def p_resume(self, session, update):
        _hit("path:session_resume")
        return resume(self, session, update)

    def p_add_input(self, session, update):
        if session.status is not RequestStatus.WAITING_FOR_INPUT:
            _hit("path:session_input_queued" if update.resumable else "path:session_close_queued")
        elif not update.resumable:
            _hit("path:session_close_aborts")
        return add_input(self, session, update)

    def p_remove_stopped(self, finished, stopped_waiting):
        if stopped_waiting:
            _hit("path:async_stale_output_finished")
        return remove_stopped(self, finished, stopped_waiting)

    def p_unschedule(self, out, victim):
        _hit("path:preempt_already_scheduled")
        return unschedule(self, out, victim)

    def p_preempt(self, req):
        n = getattr(_PROBE, "victims", 0) + 1
        _PROBE.victims = n
        if n > 1:
            _hit("path:several_victims_for_one_request")
        if req is getattr(_PROBE, "allocating", None):
            _hit("path:self_preemption")
        if req.num_in_flight_tokens:
            _hit("path:async_preempted_in_flight")
        return preempt(self, req)

    def p_cache_block(self, block, block_hash):
        if block_hash in self._cached:
            _hit("path:duplicate_hash")
        return cache_block(self, block, block_hash)

    def p_uncache(self, block):
        _hit("path:evict_cached_block")
        return uncache(self, block)

    def p_touch(self, blocks):
        blocks = list(blocks)
        if any(b.ref_cnt == 0 for b in blocks):
            _hit("path:hit_on_free_block")
        if any(b.ref_cnt > 0 for b in blocks):
            _hit("path:hit_on_held_block")
        return touch(self, blocks)

    def _chunk_probe(request, n: int) -> None:
        thr = getattr(_PROBE, "threshold", 0)
        left = request.num_tokens - request.num_computed_tokens
        if thr and n == thr < left and getattr(_PROBE, "threshold_on", False):
            _hit("path:threshold_cap")
        if thr and n > thr:
            _hit("path:threshold_lifted_for_lone_request")

    def p_allocate_slots(self, request, num_new_tokens, *a, **k):
        # A retry for the same request after a preemption keeps counting victims.
        if request is not getattr(_PROBE, "allocating", None) or not getattr(_PROBE, "retrying", False):
            _PROBE.victims = 0
            _chunk_probe(request, num_new_tokens)
        _PROBE.allocating = request
        res = allocate_slots(self, request, num_new_tokens, *a, **k)
        _PROBE.retrying = res is None
        return res

    def p_allocate_new(
        self, request, num_new_tokens, hit_blocks=(), lookahead=0, full=False, reserved=0, **kw
    ):
        res = allocate_new(self, request, num_new_tokens, hit_blocks, lookahead, full, reserved, **kw)
        if kw:
            return res  # an async KV load: none of the paths below
        hit = len(hit_blocks) * self.block_size
        thr = getattr(_PROBE, "threshold", 0)
        if (
            thr
            and num_new_tokens == thr < request.num_tokens - hit
            and getattr(_PROBE, "threshold_on", False)
        ):
            _hit("path:threshold_cap")
        if request.num_tokens - hit > num_new_tokens:
            _hit("path:admitted_partial_prefill" if res is not None else "path:partial_prefill_refused")
        if res is None:
            free = self.num_free_blocks
            chunk = self.blocks_to_admit(request, hit_blocks, num_new_tokens, lookahead)
            whole = self.blocks_to_admit(request, hit_blocks, 0, full_sequence=True) if full else 0
            if reserved and max(chunk, whole) <= free:
                _hit("path:watermark_blocked")
            elif full and chunk <= free - reserved < whole:
                _hit("path:full_isl_blocked")
            else:
                _hit("path:admission_kv_short")
        else:
            if reserved:
                _hit("path:watermark_checked")
        return res

    Scheduler.schedule, Scheduler._unschedule, Scheduler._preempt = p_schedule, p_unschedule, p_preempt
    Scheduler._remove_stopped, Scheduler._aligned_chunk = p_remove_stopped, p_aligned_chunk
    Sessions.resume, Sessions.add_input = p_resume, p_add_input
    BlockPool.cache_block, BlockPool._uncache, BlockPool.touch = p_cache_block, p_uncache, p_touch
    KVCacheManager.allocate_slots, KVCacheManager.allocate_new = p_allocate_slots, p_allocate_new


try:
    _install_probes()
except AttributeError as e:  # llmsched's internals moved: fuzz on, without path tags
    print(f"warning: decision-path probes not installed ({e})", file=sys.stderr)


def run_ours(workload: dict, paths: set[str] | None = None) -> tuple[dict, list[dict]]:
    """(resolved config, step records) of llmsched's replay; code paths taken go into ``paths``."""
    wl = parse_workload(workload)
    buf = io.StringIO()
    _PROBE.hits = paths
    _PROBE.threshold = int(wl.config.get("long_prefill_token_threshold") or 0)
    try:
        replay(wl, buf, max_steps=max_steps_for(workload))
    finally:
        _PROBE.hits = None
    header, steps = read_trace(buf.getvalue())
    return header.get("resolved", {}), steps


def block_order_is_deterministic(workload: dict) -> bool:
    """False if vLLM may free one step's blocks in an order that varies between runs.

    It frees the blocks of the requests it fails (see
    ``finish_order_is_deterministic``) and of the requests whose KV finished
    sending in one step by iterating a set of ids; the block ids it hands
    out later follow that order.
    """
    role = (workload["config"].get("kv_connector") or {}).get("role")
    return finish_order_is_deterministic(workload) and role not in ("kv_producer", "kv_both")


def set_order_step(ref: list[dict]) -> int | None:
    """The first step after whose output vLLM freed several requests' blocks in a set's order, if any.

    Several requests whose KV finished sending in one step, or several that
    failed a KV load in one step (the "fail" policy finishes them).
    """
    for s in ref:
        out = s.get("kv_out") or {}
        if len(out.get("sent") or ()) > 1 or len(out.get("failed") or ()) > 1:
            return s["step"]
    return None


def _shape(blocks: object) -> object:
    """Block ids with every id replaced by 0: which requests got how many blocks."""
    if isinstance(blocks, dict):
        return {k: _shape(v) for k, v in blocks.items()}
    if isinstance(blocks, list):
        return [_shape(v) for v in blocks]
    return 0 if isinstance(blocks, int) else blocks


def _blocks_shaped_after(steps: list[dict], step: int) -> list[dict]:
    """``steps`` with the block ids of every step after ``step`` reduced to their shape."""
    return [{**s, "blocks": _shape(s["blocks"])} if s["step"] > step and "blocks" in s else s for s in steps]


def diff_traces(
    ours: list[dict], ref: list[dict], limit: int = 5, finish_order: bool = True, block_order: bool = True
) -> list[str]:
    """Decision differences (parity.compare) then bookkeeping ones, first ``limit``.

    A reference cut off by the step cap is compared on the steps it has, and
    the cut itself is reported (last) as a difference: an unfinished run
    agrees with nothing. ``block_order`` false (``block_order_is_deterministic``):
    after the first step whose output had vLLM free several requests' blocks
    in a set's order, block ids are compared by shape only, if they differ.
    """
    capped = bool(ref) and ref[-1]["step"] >= MAX_STEPS_CONNECTOR - 10 and "kv_loads" in ref[-1]
    if capped:
        # vLLM's run stopped at the cap: compare the steps both made.
        ours = [s for s in ours if s["step"] <= ref[-1]["step"]]
    diffs = compare(ours, ref, limit, finish_order=finish_order)
    cut = set_order_step(ref) if diffs and not block_order else None
    if cut is not None:
        # The ids handed out after such a step follow an order that changes
        # with Python's string hashing: compare which requests got how many.
        diffs = compare(
            _blocks_shaped_after(ours, cut), _blocks_shaped_after(ref, cut), limit, finish_order=finish_order
        )
        if not diffs:
            _hit("order:block_ids_after_set_order_free")
    if diffs:
        # compare() counts non-empty steps; name the replay step too.
        steps = [s["step"] for s in ref if s["total_tokens"] > 0 or s.get("kv_loads")]
        out = []
        for d in diffs:
            head, sep, rest = d.partition(": ")
            k = int(head.rsplit("#", 1)[1]) if head.startswith("non-empty step #") else -1
            out.append(f"{head} (step {steps[k]}){sep}{rest}" if 0 <= k < len(steps) else d)
        return out
    if len(ours) != len(ref) and not capped:
        return [f"ours has {len(ours)} steps, ref {len(ref)}"]
    for a, b in zip(ours, ref):
        for key in BOOKKEEPING:
            if a[key] != b[key]:
                diffs.append(f"step {b['step']}: {key} ours {a[key]} vs ref {b[key]}")
        if a["admitted"] != b["admitted"]:
            diffs.append(f"step {b['step']}: admitted ours {a['admitted']} vs ref {b['admitted']}")
        if len(diffs) >= limit:
            break
    diffs = diffs[: limit - 1] if capped else diffs[:limit]
    if capped:
        diffs.append(
            f"cut: vLLM's run stopped at the {MAX_STEPS_CONNECTOR}-step cap (same decisions until then)"
        )
    return diffs


def check_workload(
    workload: dict,
    ref: tuple[dict, list[dict]] | None,
    ref_err: str | None,
    paths: set[str] | None = None,
) -> list[str]:
    """Every difference between llmsched and the reference on one workload."""
    try:
        resolved, ours = run_ours(workload, paths)
    except REJECTED as e:
        if ref_err is not None:
            return []  # both refuse: fine
        return [f"llmsched rejects a workload vLLM runs: {e}"]
    if ref_err is not None:
        return [f"vLLM rejects a workload llmsched runs: {ref_err}"]
    assert ref is not None
    header, ref_steps = ref
    diffs = [
        f"resolved {k}: ours {resolved.get(k)!r} vs ref {header['resolved'].get(k)!r}"
        for k in RESOLVED_KEYS
        if resolved.get(k) != header["resolved"].get(k)
    ]
    _PROBE.hits = paths
    try:
        return diffs + diff_traces(
            ours,
            ref_steps,
            finish_order=finish_order_is_deterministic(workload),
            block_order=block_order_is_deterministic(workload),
        )
    finally:
        _PROBE.hits = None


# ---- workload generation -------------------------------------------------------


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def prompts_of(workload: dict) -> list[list[int]]:
    """The token ids every request of ``workload`` prompts with."""
    return [
        [int(t) for t in r["prompt_token_ids"]] if "prompt_token_ids" in r else synth_prompt(r, i)
        for i, r in enumerate(workload["requests"])
    ]


def total_len(r: dict, prompt: list[int]) -> int:
    """The longest a request gets: prompt and outputs, plus a session's later inputs and theirs."""
    segs = r.get("segments") or ()
    return (
        len(prompt)
        + int(r["max_tokens"])
        + sum(
            len(sg["prompt_token_ids"]) if "prompt_token_ids" in sg else int(sg["prompt_len"]) for sg in segs
        )
        + sum(int(sg["max_tokens"]) for sg in segs)
    )


def num_answers(workload: dict) -> int:
    """Finishes a complete run reports: one per request, a session one per input."""
    return sum(1 + len(r.get("segments") or ()) for r in workload["requests"])


def resolved_mml(workload: dict, prompts: list[list[int]]) -> int:
    """max_model_len as both sides resolve it."""
    mml = workload["config"].get("max_model_len")
    if mml is None:
        mml = max(total_len(r, p) for p, r in zip(prompts, workload["requests"]))
    return int(mml)


def min_gpu_blocks(workload: dict, prompts: list[list[int]], mml: int) -> int:
    """Fewest num_gpu_blocks (null block included) with which every request can finish."""
    cfg = workload["config"]
    bs = int(cfg.get("block_size", 16))
    # The KV of every token but the last sampled one. Draft slots past it count
    # only from a block's worth on (llmsched's add_request, and vLLM's padded
    # resume): fewer that do not fit preempt the request, which resumes without.
    k = int(cfg.get("num_speculative_tokens") or 0)
    if k < bs:
        k = 0
    need = max(
        _cdiv(min(min(total_len(r, p), mml) - 1 + k, mml), bs) for p, r in zip(prompts, workload["requests"])
    )
    if cfg.get("mamba"):
        # Mamba states on the same pool: two at a time with prefix caching
        # (the chunk's and the one it starts from), a token window without.
        need = need + 2 if cfg.get("enable_prefix_caching", True) else 2 * need + 2
    return 1 + need


def default_gpu_blocks(workload: dict, prompts: list[list[int]]) -> int:
    """num_gpu_blocks the format's null resolves to."""
    cfg = workload["config"]
    bs = int(cfg.get("block_size", 16))
    n = sum(_cdiv(total_len(r, p), bs) for p, r in zip(prompts, workload["requests"]))
    return 1 + n * (2 if cfg.get("mamba") else 1)


def is_valid(workload: dict) -> bool:
    """Whether every request can fit and every knob is in range (see REPLAY.md)."""
    cfg = workload["config"]
    if not workload["requests"]:
        return False
    prompts = prompts_of(workload)
    if any(len(p) == 0 for p in prompts) or any(int(r["max_tokens"]) < 1 for r in workload["requests"]):
        return False
    mml = resolved_mml(workload, prompts)
    if any(len(p) >= mml for p in prompts):
        return False
    blocks = cfg.get("num_gpu_blocks")
    if blocks is not None and blocks < min_gpu_blocks(workload, prompts, mml):
        return False
    mnbt = cfg.get("max_num_batched_tokens", 8192)
    if mnbt < cfg.get("max_num_seqs", 256):
        return False
    if not cfg.get("enable_chunked_prefill", True) and mnbt < mml:
        return False
    # A padded draft step (1 + K tokens) the budget or the threshold can
    # never hold: vLLM waits forever, llmsched does not pad (documented).
    step = 1 + int(cfg.get("num_speculative_tokens") or 0)
    thr = cfg.get("long_prefill_token_threshold", 0)
    if step > 1 and (mnbt < step or 0 < thr < step):
        return False
    return thr <= mml


class Gen:
    """Random workloads with random knob mixes, sized by ``profile``.

    ``small`` keeps traces short (for the corpus), ``large`` makes many long
    requests compete for a tight cache, ``preempt`` aims at preemptions in
    the middle of a step (a long low-priority prompt prefilling in chunks,
    outranked by short later arrivals, in a cache with hardly a spare block),
    ``mixed`` draws one of the others.
    """

    PROFILES = ("small", "normal", "large", "preempt", "mixed")
    # Scheduling modes: vLLM's sync Scheduler, its AsyncScheduler, or either.
    MODES = ("sync", "async", "mixed")

    # A scripted KV connector: never (the corpora before it), always, or either.
    CONNECTOR = ("off", "on", "mixed")
    # A hybrid (Mamba) model, streaming-input sessions, both, or any of them.
    HYBRID = ("off", "mamba", "sessions", "both", "mixed")
    # Encoder inputs (images) in prompts, with an encoder budget and cache.
    MM = ("off", "on", "mixed")
    # Per-request scripts (docs/replay_scripts.md): early finishes, draft
    # tokens, grammar waits, LoRA adapters with too few slots.
    SCRIPTS = ("off", "on", "mixed")

    def __init__(
        self,
        rng: random.Random,
        profile: str = "mixed",
        mode: str = "sync",
        connector: str = "off",
        hybrid: str = "off",
        mm: str = "off",
        scripts: str = "off",
    ) -> None:
        self.rng = rng
        self.scripts = scripts
        self.profile = profile
        self.mode = mode
        self.connector = connector
        self.hybrid = hybrid
        self.mm = mm
        # A tiny alphabet makes unrelated prompts (and generated tokens) share
        # blocks, which stresses duplicate hashes and eviction order.
        self.alphabet: tuple[int, ...] | None = None

    def tokens(self, n: int) -> list[int]:
        """Random token ids: from the workload's tiny alphabet, or a wide range."""
        if self.alphabet is not None:
            return [self.rng.choice(self.alphabet) for _ in range(n)]
        return [self.rng.randrange(10, 30000) for _ in range(n)]

    def length(self, bs: int, cap: int) -> int:
        """A prompt length, biased towards the edge cases of block arithmetic."""
        rng = self.rng
        x = rng.random()
        if x < 0.08:
            return 1
        if x < 0.18:
            return bs
        if x < 0.33:
            return bs * rng.randint(1, max(1, cap // bs))
        if x < 0.40:
            return max(1, bs * rng.randint(1, max(1, cap // bs)) + rng.choice((-1, 1)))
        return rng.randint(2, cap)

    def workload(self) -> tuple[dict, set[str]]:
        """A valid random workload and the generator-side features it exercises."""
        while True:
            profile = self.profile
            if profile == "mixed":
                profile = self.rng.choice(("small", "normal", "normal", "large", "preempt"))
            wl, feats = self._attempt_preempt() if profile == "preempt" else self._attempt(profile)
            feats.add(f"profile:{profile}")
            # Drawn last, so a sync run's workloads are the ones it always made.
            if self.mode == "async" or (self.mode == "mixed" and self.rng.random() < 0.5):
                wl["config"]["async_scheduling"] = True
            if self.connector == "on" or (self.connector == "mixed" and self.rng.random() < 0.5):
                self._add_connector(wl)
            if self.hybrid != "off" and not wl["config"].get("kv_connector"):
                kind = self.hybrid
                if kind == "mixed":
                    kind = self.rng.choice(("mamba", "sessions", "both"))
                if kind in ("sessions", "both"):
                    self._add_sessions(wl)
                if kind in ("mamba", "both"):
                    wl["config"]["mamba"] = True
                self._fit_blocks(wl)
            if self.mm == "on" or (self.mm == "mixed" and self.rng.random() < 0.5):
                wl = self._add_mm(wl)
            if self.scripts == "on" or (self.scripts == "mixed" and self.rng.random() < 0.5):
                self._add_scripts(wl)
            if is_valid(wl):
                return wl, feats

    def _add_scripts(self, wl: dict) -> None:
        """Random per-request scripts: EOS / stop finishes, drafts, grammar waits, LoRA adapters."""
        rng = self.rng
        cfg = wl["config"]
        reqs = wl["requests"]
        sessions = any(r.get("segments") for r in reqs)
        # Drafts with a hybrid model, encoder inputs or sessions are left to later work.
        other = cfg.get("mamba") or sessions or any(r.get("mm") for r in reqs)
        if rng.random() < 0.6 and not other:
            k = rng.randint(1, 5)
            cfg["num_speculative_tokens"] = k
            for r in reqs:
                if rng.random() < 0.8:
                    n = int(r["max_tokens"]) + rng.choice((0, 0, 4))
                    steps = [[rng.randint(0, k), rng.choice((0, rng.randint(0, k), k))] for _ in range(n)]
                    r["spec"] = steps[: rng.choice((n, rng.randint(0, n)))]
            self._fit_blocks(wl)
        if rng.random() < 0.5:
            for r in reqs:
                if rng.random() < 0.4:
                    r["grammar_steps"] = rng.choice((0, 1, 2, rng.randint(1, 10)))
        if rng.random() < 0.5:
            adapters = rng.randint(2, 5)
            cfg["max_loras"] = rng.randint(1, adapters - 1)
            for r in reqs:
                if rng.random() < 0.75:
                    r["lora_id"] = rng.randint(1, adapters)
        if rng.random() < 0.5:
            for r in reqs:
                mt = int(r["max_tokens"])
                if mt > 1 and rng.random() < 0.3:
                    r[rng.choice(("eos_at", "stop_at"))] = rng.randint(1, mt - 1)

    def _add_sessions(self, wl: dict) -> None:
        """Make some requests streaming-input sessions with later inputs at random steps."""
        rng = self.rng
        bs = int(wl["config"].get("block_size", 16))
        for r in wl["requests"]:
            if rng.random() < 0.4:
                continue
            at = int(r.get("arrival_step", 0))
            segs = []
            for _ in range(rng.choice((1, 1, 2, 3))):
                at += rng.choice((0, 1, rng.randint(1, 8), rng.randint(5, 40)))
                mt = rng.choice((1, rng.randint(1, 8), rng.randint(4, 24)))
                seg: dict = {"arrival_step": at, "max_tokens": mt}
                n = rng.choice((1, rng.randint(1, bs), rng.randint(bs, 4 * bs)))
                if rng.random() < 0.6:
                    seg["prompt_token_ids"] = self.tokens(n)
                else:
                    seg["prompt_len"] = n
                segs.append(seg)
            r["segments"] = segs
            if rng.random() < 0.3:
                r["close_step"] = at + rng.randint(0, 30)
        # A session may grow up to its whole length: let max_model_len resolve to it.
        wl["config"].pop("max_model_len", None)

    def _fit_blocks(self, wl: dict) -> None:
        """Raise an explicit num_gpu_blocks to what every request (and its state blocks) needs."""
        cfg = wl["config"]
        if cfg.get("num_gpu_blocks") is None:
            return
        prompts = prompts_of(wl)
        lo = min_gpu_blocks(wl, prompts, resolved_mml(wl, prompts))
        if cfg["num_gpu_blocks"] < lo:
            cfg["num_gpu_blocks"] = lo + self.rng.choice((0, 0, 1, 2, 4, 8))

    def _add_mm(self, wl: dict) -> dict:
        """Images in random prompts: placeholder runs, ids from a small shared pool, a tight encoder side."""
        rng = self.rng
        wl = _materialize(wl)
        cfg = wl["config"]
        mnbt = int(cfg.get("max_num_batched_tokens", 8192))
        bs = int(cfg.get("block_size", 16))
        # The largest item: every item must fit the budget and the cache, or it never runs.
        cap = max(1, min(mnbt, rng.choice((4, bs, 2 * bs, 64, 144))))
        sizes = [
            rng.choice((cap, bs if bs <= cap else cap, rng.randint(1, cap))) for _ in range(rng.randint(1, 6))
        ]
        cap = max(sizes)
        x = rng.random()
        if x < 0.7:
            cfg["max_num_encoder_input_tokens"] = rng.choice((cap, cap + rng.randint(0, cap), 2 * cap))
        if rng.random() < 0.8:
            cfg["encoder_cache_size"] = rng.choice((cap, cap + rng.randint(0, cap), 2 * cap, 4 * cap))
        threshold = int(cfg.get("long_prefill_token_threshold", 0) or 0)
        if rng.random() < 0.3 and (threshold == 0 or threshold >= cap):
            cfg["scheduler_extra"] = {"disable_chunked_mm_input": True}
        for r in wl["requests"]:
            if rng.random() < 0.25:
                continue
            p = r["prompt_token_ids"]
            items = []
            pos = 0
            for _ in range(rng.choice((1, 1, 2, 3))):
                k = rng.randrange(len(sizes))
                length = sizes[k]
                if rng.random() < 0.01:
                    length = rng.randint(1, cap)  # the same id at another size: vLLM fails the request
                offset = pos + rng.choice((0, rng.randint(0, bs), rng.randint(0, 3 * bs)))
                if offset + length > len(p):
                    break
                p[offset : offset + length] = [31999] * length
                items.append({"offset": offset, "length": length, "id": f"img{k}"})
                pos = offset + length
            if items:
                r["mm"] = items
        return wl

    def _add_connector(self, wl: dict) -> None:
        """A scripted KV connector with a random role and policy, and random per-request scripts."""
        rng = self.rng
        role = rng.choice(("kv_consumer", "kv_consumer", "kv_producer", "kv_both", "kv_both"))
        conn: dict = {"role": role}
        if rng.random() < 0.8:
            conn["load_failure_policy"] = rng.choice(("recompute", "fail"))
        wl["config"]["kv_connector"] = conn
        prompts = prompts_of(wl)
        for r, p in zip(wl["requests"], prompts):
            if rng.random() < 0.2:
                continue
            kv: dict = {}
            if role != "kv_producer" or rng.random() < 0.2:
                x = rng.random()
                total = len(p) + int(r["max_tokens"])
                if x < 0.3:
                    kv["external"] = len(p)
                elif x < 0.5:
                    kv["external"] = rng.randint(0, total + 4)
                elif x < 0.8:
                    kv["external"] = max(0, len(p) - rng.randint(0, len(p)))
                else:
                    kv["external"] = 16 * rng.randint(0, max(1, len(p) // 16 + 1))
                if role == "kv_consumer":
                    kv["async"] = rng.random() < 0.8
                elif rng.random() < 0.8:
                    kv["async"] = rng.random() < 0.4
                if rng.random() < 0.7:
                    kv["recv_steps"] = rng.choice((0, 1, 1, 2, 3, rng.randint(1, 12)))
                if rng.random() < 0.25:
                    kv["fail"] = True
                if rng.random() < 0.6:
                    kv["offer"] = rng.choice(("once", "always"))
                if len(p) == 1 and kv.get("async", True):
                    # Loading a one-token prompt whole leaves nothing computed:
                    # offered again, it would load forever (in vLLM too).
                    kv["offer"] = "once"
            # A send after a failed load ending the request is a script vLLM cannot follow.
            if role != "kv_consumer" and not kv.get("fail") and rng.random() < 0.8:
                kv["send_steps"] = rng.choice((0, 1, 1, 2, 3, rng.randint(1, 12)))
            if kv:
                r["kv"] = kv

    def _attempt_preempt(self) -> tuple[dict, set[str]]:
        rng = self.rng
        feats: set[str] = set()
        bs = rng.choice((8, 8, 16))
        x = rng.random()
        self.alphabet = None if x < 0.85 else (7,)
        reqs = [
            {
                "id": "0",
                "arrival_step": 0,
                "prompt_token_ids": self.tokens(rng.randint(3 * bs, 12 * bs)),
                "max_tokens": rng.randint(1, 12),
                "priority": 1,
            }
        ]
        for i in range(1, rng.randint(2, 5)):
            reqs.append(
                {
                    "id": str(i),
                    "arrival_step": rng.randint(1, 4),
                    "prompt_token_ids": self.tokens(rng.randint(1, 5 * bs)),
                    "max_tokens": rng.randint(1, 20),
                    "priority": rng.choice((0, 0, 0, 1, 2)),
                }
            )
        if rng.random() < 0.3:
            # Another prompt sharing the long one's first blocks.
            head = reqs[0]["prompt_token_ids"][: bs * rng.randint(1, 3)]
            reqs[-1]["prompt_token_ids"] = head + self.tokens(rng.randint(0, bs))
        mns = rng.choice((2, 4, 8))
        cfg: dict = {
            "block_size": bs,
            "policy": "priority" if rng.random() < 0.85 else "fcfs",
            "max_num_seqs": mns,
            "max_num_batched_tokens": max(mns, rng.randint(bs, 6 * bs)),
            "scheduler_reserve_full_isl": rng.random() < 0.5,
        }
        if rng.random() < 0.6:
            cfg["long_prefill_token_threshold"] = rng.randint(bs // 2, 3 * bs)
        if rng.random() < 0.2:
            cfg["watermark"] = round(rng.uniform(0.01, 0.2), 3)
        if rng.random() < 0.1:
            cfg["enable_prefix_caching"] = False
        wl = {"config": cfg, "requests": reqs}
        prompts = prompts_of(wl)
        cfg["num_gpu_blocks"] = min_gpu_blocks(wl, prompts, resolved_mml(wl, prompts)) + rng.randint(0, 8)
        feats.add("form:ids")
        return wl, feats

    def _attempt(self, profile: str) -> tuple[dict, set[str]]:
        rng = self.rng
        feats: set[str] = set()
        bs = rng.choice((8, 16, 32))
        policy = rng.choice(("fcfs", "priority"))
        small = profile == "small"
        if small:
            n = rng.choice((1, 2, 2, 3, 3, 4, 4, 5, 6, 8))
            cap = min(rng.choice((2 * bs, 4 * bs, 6 * bs)), 160)
        elif profile == "normal":
            n = rng.choice((1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24))
            cap = rng.choice((2 * bs, 4 * bs, 8 * bs, 16 * bs))
        else:
            n = rng.randint(16, 64)
            cap = rng.choice((8 * bs, 16 * bs, 32 * bs))
        form = rng.choice(("ids", "len", "mixed"))
        x = rng.random()
        self.alphabet = None if x < 0.8 else (7,) if x < 0.9 else (7, 8)
        if self.alphabet is not None:
            feats.add("tokens:tiny_alphabet")
        group_bases = []
        for _ in range(rng.randint(1, 3)):
            if rng.random() < 0.7:
                base_len = bs * rng.randint(1, max(1, min(4, cap // bs)))
            else:
                base_len = rng.randint(2, cap)
            group_bases.append(self.tokens(base_len))
        reqs: list[dict] = []
        prompts: list[list[int]] = []
        for i in range(n):
            r: dict = {}
            use_ids = form == "ids" or (form == "mixed" and rng.random() < 0.5)
            if use_ids:
                style = rng.choices(
                    ("unique", "group", "copy", "one_token", "one_block"), (4, 4, 1.5, 0.7, 0.8)
                )[0]
                if style == "copy" and prompts:
                    toks = list(rng.choice(prompts))
                elif style == "group" or style == "copy":
                    base = rng.choice(group_bases)
                    cut = rng.random()
                    if cut < 0.4:
                        take = len(base)
                    elif cut < 0.8:
                        take = bs * rng.randint(0, len(base) // bs)
                    else:
                        take = rng.randint(1, len(base))
                    suffix = rng.choice((0, 0, 1, rng.randint(1, 2 * bs), rng.randint(1, cap)))
                    toks = base[:take] + self.tokens(suffix)
                    if len(base) % bs == 0 and take == len(base):
                        feats.add("prompt:prefix_block_multiple")
                    if not toks:
                        toks = self.tokens(1)
                elif style == "one_token":
                    toks = self.tokens(1)
                else:
                    base = rng.choice(group_bases)
                    toks = base[:bs] if len(base) >= bs and rng.random() < 0.5 else self.tokens(bs)
                r["prompt_token_ids"] = toks
                feats.add("form:ids")
            else:
                plen = self.length(bs, cap)
                r["prompt_len"] = plen
                if rng.random() < 0.5:
                    k = rng.choice((bs, 2 * bs, rng.randint(1, plen), plen, plen + 3))
                    r["shared_prefix_len"] = k
                    if k % bs == 0 and k <= plen:
                        feats.add("prompt:prefix_block_multiple")
                    if rng.random() < 0.8:
                        r["prefix_group"] = rng.choice(("a", "b"))
                toks = synth_prompt(r, i)
                feats.add("form:len")
            prompts.append(toks)
            x = rng.random()
            if x < 0.15:
                mt = 1
            elif x < 0.85:
                mt = rng.randint(1, 24 if small else 48)
            else:
                mt = rng.randint(1, 64 if small else 200 if profile == "normal" else 400)
            r["max_tokens"] = mt
            if policy == "priority" or rng.random() < 0.1:
                r["priority"] = rng.choice((0, 0, 1, 1, 2, 3, -1))
            if rng.random() < 0.08:
                r["sample_token_id"] = rng.choice((7, 11, rng.randrange(10, 30000)))
            reqs.append(r)

        ids = [str(i) for i in range(n)]
        if rng.random() < 0.3:
            labels = rng.sample(range(10 * n + 10), n)
            ids = [f"r{x}" for x in labels]
        for r, rid in zip(reqs, ids):
            r["id"] = rid

        # Arrivals: all at once, spread, or bursts separated by idle gaps.
        x = rng.random()
        if x < 0.35:
            arrivals = [0] * n
        elif x < 0.7:
            horizon = rng.randint(1, 40)
            arrivals = [rng.randint(0, horizon) for _ in range(n)]
            feats.add("arrivals:spread")
        else:
            starts = sorted(rng.sample(range(400), rng.randint(2, 4)))
            arrivals = [rng.choice(starts) + rng.randint(0, 3) for _ in range(n)]
            feats.add("arrivals:bursts")
        for r, a in zip(reqs, arrivals):
            r["arrival_step"] = a
        if policy == "priority" and len(set(arrivals)) > 1 and rng.random() < 0.35:
            # Later arrivals outrank earlier ones: the victims are then requests
            # already scheduled earlier in the same step, often mid-prefill.
            ranks = sorted(set(arrivals))
            for r in reqs:
                r["priority"] = len(ranks) - ranks.index(r["arrival_step"]) + rng.choice((0, 0, 1))
            feats.add("priority:late_arrivals_outrank")

        needed = max(len(p) + r["max_tokens"] for p, r in zip(prompts, reqs))
        longest = max(len(p) for p in prompts)
        cfg: dict = {"block_size": bs, "policy": policy}
        x = rng.random()
        if x < 0.5:
            mml = needed
            feats.add("mml:null")
        elif x < 0.75:
            mml = needed + rng.randint(1, 200)
            cfg["max_model_len"] = mml
            feats.add("mml:larger")
        else:
            mml = rng.randint(longest + 1, needed)
            cfg["max_model_len"] = mml
            feats.add("mml:truncating" if mml < needed else "mml:exact")

        chunked = rng.random() < 0.65
        cfg["enable_chunked_prefill"] = chunked
        mns = rng.choice((1, 2, 3, 4, 6, 8, 16, 64, 256))
        cfg["max_num_seqs"] = mns
        if chunked:
            mnbt = rng.choice((mns, rng.randint(1, 32), rng.randint(8, 128), rng.randint(64, 1024), 8192))
        else:
            mnbt = rng.choice((mml, mml + rng.randint(1, 64), rng.randint(mml, 4 * mml), 8192))
        cfg["max_num_batched_tokens"] = max(mnbt, mns, 1)
        if rng.random() < 0.4:
            cfg["long_prefill_token_threshold"] = rng.choice(
                (rng.randint(1, min(mml, 2 * bs)), rng.randint(1, mml), mml)
            )
        if rng.random() < 0.4:
            cfg["watermark"] = round(rng.uniform(0.01, 0.3), 3)
        # Knobs are sometimes left out so that both sides' defaults are compared too.
        x = rng.random()
        if x < 0.75:
            cfg["scheduler_reserve_full_isl"] = x < 0.4
        x = rng.random()
        if x < 0.75:
            cfg["enable_prefix_caching"] = x < 0.55
        if chunked and rng.random() < 0.2:
            del cfg["enable_chunked_prefill"]
        if rng.random() < 0.1:
            cfg["sample_token_id"] = rng.randrange(10, 30000)
        wl = {"config": cfg, "requests": reqs}

        lo = min_gpu_blocks(wl, prompts, mml)
        hi = default_gpu_blocks(wl, prompts)
        x = rng.random()
        if x < 0.4:
            cfg["num_gpu_blocks"] = lo + rng.choice((0, 0, 1, 2, 3))
        elif x < 0.65:
            cfg["num_gpu_blocks"] = rng.randint(lo, max(lo, (lo + hi) // 2))
        elif x < 0.85:
            pass  # null: roomy
        else:
            cfg["num_gpu_blocks"] = max(lo, hi) + rng.randint(0, 64)
        return wl, feats


def features(workload: dict, ref_steps: list[dict] | None = None) -> set[str]:
    """Knob values and workload shapes a case exercises (for coverage and corpus choice)."""
    cfg = workload["config"]
    reqs = workload["requests"]
    prompts = prompts_of(workload)
    bs = int(cfg.get("block_size", 16))
    mml = resolved_mml(workload, prompts)
    f = {
        f"policy:{cfg.get('policy', 'fcfs')}",
        f"chunked:{'on' if cfg.get('enable_chunked_prefill', True) else 'off'}",
        f"threshold:{'>0' if cfg.get('long_prefill_token_threshold', 0) else '0'}",
        f"watermark:{'>0' if cfg.get('watermark', 0.0) else '0'}",
        f"reserve_full_isl:{str(cfg.get('scheduler_reserve_full_isl', True)).lower()}",
        f"prefix_caching:{'on' if cfg.get('enable_prefix_caching', True) else 'off'}",
        f"block_size:{bs}",
        f"sched:{'async' if cfg.get('async_scheduling') else 'sync'}",
    }
    f |= connector_features(workload, ref_steps)
    if cfg.get("mamba"):
        f.add("mamba:align" if cfg.get("enable_prefix_caching", True) else "mamba:none")
    sessions = {str(r.get("id", i)) for i, r in enumerate(reqs) if r.get("segments")}
    if sessions:
        f.add("sessions")
        if any(r.get("close_step") is not None for r in reqs):
            f.add("sessions:close_step")
    if sessions and ref_steps:
        turns: Counter[str] = Counter()
        for s in ref_steps:
            for rid, hit, _ in s["admitted"]:
                if rid in sessions and turns[rid] and hit:
                    f.add("obs:session_resumed_with_kv")
            turns.update(rid for rid in s["finished"] if rid in sessions)
    f |= mm_features(workload, ref_steps)
    if cfg.get("num_speculative_tokens"):
        f.add("scripts:spec")
        if ref_steps and any(a[0] in (s.get("drafts") or {}) for s in ref_steps for a in s["admitted"]):
            f.add("obs:padded_admission")
    scripted = (("grammar_steps", "grammar"), ("lora_id", "lora"), ("eos_at", "stops"), ("stop_at", "stops"))
    for key, name in scripted:
        if any(r.get(key) is not None for r in reqs):
            f.add(f"scripts:{name}")
    blocks = cfg.get("num_gpu_blocks")
    lo = min_gpu_blocks(workload, prompts, mml)
    if blocks is not None and blocks <= lo + 3:
        f.add("kv:tight")
    elif blocks is None or blocks >= default_gpu_blocks(workload, prompts):
        f.add("kv:roomy")
    else:
        f.add("kv:medium")
    mns = cfg.get("max_num_seqs", 256)
    f.add("max_num_seqs:small" if mns <= 4 else "max_num_seqs:large" if mns >= 64 else "max_num_seqs:mid")
    mnbt = cfg.get("max_num_batched_tokens", 8192)
    f.add("mnbt:small" if mnbt <= 64 else "mnbt:large" if mnbt >= 2048 else "mnbt:mid")
    if cfg.get("max_model_len") is not None:
        needed = max(len(p) + int(r["max_tokens"]) for p, r in zip(prompts, reqs))
        f.add("mml:larger" if mml > needed else "mml:truncating" if mml < needed else "mml:exact")
    if any(int(r["max_tokens"]) == 1 for r in reqs):
        f.add("max_tokens:1")
    if any(len(p) == 1 for p in prompts):
        f.add("prompt:one_token")
    if any(len(p) == bs for p in prompts):
        f.add("prompt:one_block")
    if any(len(p) % bs == 0 and len(p) > bs for p in prompts):
        f.add("prompt:block_multiple")
    f.add("form:ids" if any("prompt_token_ids" in r for r in reqs) else "form:len")
    if any("prompt_len" in r for r in reqs):
        f.add("form:len")
    if any("shared_prefix_len" in r for r in reqs):
        f.add("form:shared_prefix_len")
    seen: set[tuple[int, ...]] = set()
    for p in prompts:
        if tuple(p) in seen:
            f.add("prompt:identical")
        seen.add(tuple(p))
    firsts: Counter[tuple[int, ...]] = Counter(tuple(p[:bs]) for p in prompts if len(p) >= bs)
    if any(c > 1 for c in firsts.values()):
        f.add("prompt:shared_blocks")
    if cfg.get("policy") == "priority":
        pr = Counter(int(r.get("priority", 0)) for r in reqs)
        if any(c > 1 for c in pr.values()):
            f.add("priority:ties")
        if len(pr) > 1:
            f.add("priority:mixed")
    if len({int(r.get("arrival_step", 0)) for r in reqs}) > 1:
        f.add("arrivals:spread")
    if ref_steps:
        steps = [s["step"] for s in ref_steps]
        if any(b - a > 1 for a, b in itertools.pairwise(steps)):
            f.add("obs:idle_gap")
        for s in ref_steps:
            if s["preempted"]:
                f.add("obs:preemption")
            for _, hit, kind in s["admitted"]:
                if hit:
                    f.add("obs:prefix_hit")
                if kind == "resumed":
                    f.add("obs:resumed")
                    if hit:
                        f.add("obs:resumed_prefix_hit")
            if len(s["preempted"]) > 1:
                f.add("obs:multi_preemption")
            if s["total_tokens"] == cfg.get("max_num_batched_tokens", 8192):
                f.add("obs:budget_full")
    return f


def connector_features(workload: dict, ref_steps: list[dict] | None) -> set[str]:
    """What a case with a scripted KV connector exercises (nothing without one)."""
    conn = workload["config"].get("kv_connector")
    if not conn:
        return set()
    f = {
        f"connector:{conn.get('role', 'kv_consumer')}",
        f"connector:policy_{conn.get('load_failure_policy', 'recompute')}",
    }
    for r in workload["requests"]:
        kv = r.get("kv") or {}
        if kv.get("offer") == "always":
            f.add("connector:offer_always")
    preempted: set[str] = set()
    for s in ref_steps or ():
        for rid, _, is_async in s.get("kv_loads") or ():
            f.add("obs:kv_load_async" if is_async else "obs:kv_load_sync")
            if rid in preempted:
                f.add("obs:kv_load_after_preemption")
        preempted.update(s["preempted"])
        out = s.get("kv_out") or {}
        f |= {f"obs:kv_{k}" for k in ("failed", "invalid", "sent") if out.get(k)}
    return f


def mm_features(workload: dict, ref_steps: list[dict] | None) -> set[str]:
    """What a case with encoder inputs exercises (nothing without them)."""
    items = [m for r in workload["requests"] for m in r.get("mm") or ()]
    if not items:
        return set()
    cfg = workload["config"]
    f = {"mm:on"}
    if (cfg.get("scheduler_extra") or {}).get("disable_chunked_mm_input"):
        f.add("mm:no_chunked_mm_input")
    ids = Counter(m["id"] for m in items)
    if any(c > 1 for c in ids.values()):
        f.add("mm:shared_image")
    if len({(m["id"], m["length"]) for m in items}) > len(ids):
        f.add("mm:id_size_mismatch")
    for s in ref_steps or ():
        if s.get("enc"):
            f.add("obs:enc_scheduled")
        if s.get("enc_freed"):
            f.add("obs:enc_evicted")
        if s["preempted"]:
            f.add("obs:mm_preemption")
    return f


def mix_key(workload: dict) -> str:
    """The knob mix of a workload, as one label."""
    cfg = workload["config"]
    f = features(workload)
    kv = next(x for x in f if x.startswith("kv:"))
    return ",".join(
        [
            cfg.get("policy", "fcfs"),
            "chunk" if cfg.get("enable_chunked_prefill", True) else "nochunk",
            "thr" if cfg.get("long_prefill_token_threshold", 0) else "nothr",
            "wm" if cfg.get("watermark", 0.0) else "nowm",
            "fullisl" if cfg.get("scheduler_reserve_full_isl", True) else "nofullisl",
            "pc" if cfg.get("enable_prefix_caching", True) else "nopc",
            "async" if cfg.get("async_scheduling") else "sync",
            kv,
        ]
    )


# ---- shrinking -----------------------------------------------------------------


def _materialize(workload: dict) -> dict:
    """The workload with every prompt as explicit ids (so prompts can be cut)."""
    w = json.loads(json.dumps(workload))
    for r, p in zip(w["requests"], prompts_of(workload)):
        for k in ("prompt_len", "shared_prefix_len", "prefix_group"):
            r.pop(k, None)
        r["prompt_token_ids"] = p
    return w


def _candidates(w: dict) -> Iterator[dict]:
    """Simpler variants of ``w``, most aggressive first."""
    reqs = w["requests"]
    n = len(reqs)
    cfg = w["config"]

    def with_reqs(rs: list[dict]) -> dict:
        return {"config": dict(cfg), "requests": rs}

    def with_cfg(**kv: object) -> dict:
        c = dict(cfg)
        for k, v in kv.items():
            if v is None:
                c.pop(k, None)
            else:
                c[k] = v
        return {"config": c, "requests": json.loads(json.dumps(reqs))}

    chunk = n // 2
    while chunk >= 1:
        for s in range(0, n, chunk):
            if n - chunk >= 1:
                yield with_reqs(reqs[:s] + reqs[s + chunk :])
        chunk //= 2
    # Scale the whole workload down at once: a preemption needs the prompts and
    # the cache to shrink together, which one-knob steps cannot do.
    for num, den in ((1, 2), (3, 4)):
        small = with_cfg()
        for r in small["requests"]:
            p = r["prompt_token_ids"]
            r["prompt_token_ids"] = p[: max(1, -(-len(p) * num // den))]
            r["max_tokens"] = max(1, -(-r["max_tokens"] * num // den))
        c = small["config"]
        for k in (
            "num_gpu_blocks",
            "max_num_batched_tokens",
            "max_model_len",
            "long_prefill_token_threshold",
        ):
            if c.get(k):
                c[k] = max(1, -(-c[k] * num // den))
        if c.get("num_gpu_blocks"):
            prompts = prompts_of(small)
            c["num_gpu_blocks"] = max(
                c["num_gpu_blocks"], min_gpu_blocks(small, prompts, resolved_mml(small, prompts))
            )
        yield small
    for k in ("long_prefill_token_threshold", "watermark", "sample_token_id"):
        if cfg.get(k):
            yield with_cfg(**{k: None})
    if "max_model_len" in cfg:
        yield with_cfg(max_model_len=None)
    blocks = cfg.get("num_gpu_blocks")
    if blocks is not None:
        yield with_cfg(num_gpu_blocks=None)
        prompts = prompts_of(w)
        lo = min_gpu_blocks(w, prompts, resolved_mml(w, prompts))
        for b in sorted({lo, (lo + blocks) // 2, blocks - 1}):
            if b < blocks:
                yield with_cfg(num_gpu_blocks=b)
    mnbt = cfg.get("max_num_batched_tokens", 8192)
    for m in sorted({cfg.get("max_num_seqs", 256), mnbt // 2, mnbt - 1}):
        if 1 <= m < mnbt:
            yield with_cfg(max_num_batched_tokens=m)
    if cfg.get("max_num_seqs", 256) != 256:
        yield with_cfg(max_num_seqs=256)
    if cfg.get("max_num_batched_tokens", 8192) != 8192:
        yield with_cfg(max_num_batched_tokens=8192)
    if cfg.get("policy") == "priority":
        yield with_cfg(policy="fcfs")
    if cfg.get("enable_prefix_caching", True):
        yield with_cfg(enable_prefix_caching=False)
    if not cfg.get("enable_chunked_prefill", True):
        yield with_cfg(enable_chunked_prefill=True)
    for k in ("scheduler_reserve_full_isl",):
        if k in cfg:
            yield with_cfg(**{k: None})
    for i, r in enumerate(reqs):
        variants = []
        if r.get("arrival_step", 0):
            variants.append({"arrival_step": 0})
            variants.append({"arrival_step": r["arrival_step"] // 2})
        if r.get("priority", 0):
            variants.append({"priority": 0})
        if "sample_token_id" in r:
            variants.append({"sample_token_id": None})
        mt = r["max_tokens"]
        for m in sorted({1, mt // 2, mt - 1}):
            if 1 <= m < mt:
                variants.append({"max_tokens": m})
        p = r["prompt_token_ids"]
        bs = int(cfg.get("block_size", 16))
        for m in sorted({1, len(p) // 2, len(p) - bs, len(p) - 1}):
            if 1 <= m < len(p):
                variants.append({"prompt_token_ids": p[:m]})
                variants.append({"prompt_token_ids": p[len(p) - m :]})
        for v in variants:
            rs = json.loads(json.dumps(reqs))
            for k, x in v.items():
                if x is None:
                    rs[i].pop(k, None)
                else:
                    rs[i][k] = x
            yield with_reqs(rs)
    # Shift all arrivals down together: keeps their spacing, drops the lead-in.
    lead = min(r.get("arrival_step", 0) for r in reqs)
    if lead:
        rs = json.loads(json.dumps(reqs))
        for r in rs:
            r["arrival_step"] = r.get("arrival_step", 0) - lead
        yield with_reqs(rs)


def _size(w: dict) -> tuple[int, ...]:
    """How complex a workload is; shrinking only accepts strictly smaller ones."""
    reqs = w["requests"]
    cfg = w["config"]
    return (
        len(reqs),
        sum(len(r["prompt_token_ids"]) for r in reqs) + sum(r["max_tokens"] for r in reqs),
        len(cfg) + sum(len(r) for r in reqs),
        sum(r.get("arrival_step", 0) for r in reqs),
        cfg.get("num_gpu_blocks") or 1 << 30,
        cfg.get("max_num_batched_tokens", 8192),
    )


def shrink(workload: dict, fails: Callable[[dict], bool], budget: int = 3000) -> dict:
    """Greedily simplify ``workload`` while ``fails`` still holds for it."""
    best = _materialize(workload)
    tries = 0
    improved = True
    while improved and tries < budget:
        improved = False
        for cand in _candidates(best):
            if not is_valid(cand) or _size(cand) >= _size(best):
                continue
            tries += 1
            if fails(cand):
                best = cand
                improved = True
                break
            if tries >= budget:
                break
    return best


# ---- corpus records ------------------------------------------------------------


def compact_steps(steps: list[dict]) -> list[list]:
    """What the regression test needs of each step, as a short list."""
    return [
        [
            s["step"],
            s["total_tokens"],
            s["sched"],
            s["admitted"],
            s["preempted"],
            s["finished"],
            s["num_running"],
            s["num_waiting"],
            s["kv_usage"],
            # With a KV connector: the loads started, and the events the step's output carried.
            *(
                [s["kv_loads"], s.get("kv_out") or {}]
                if "kv_loads" in s
                else [None, None]
                if "enc" in s or "blocks" in s
                else []
            ),
            # With encoder inputs: the items encoded and the encoder-cache evictions.
            *([s["enc"], s["enc_freed"]] if "enc" in s else [None, None] if "blocks" in s else []),
            # Recorded by tools/drive_vllm.py: the block ids handed over.
            *([s["blocks"]] if "blocks" in s else []),
        ]
        for s in steps
    ]


def dump_workload(workload: dict) -> str:
    """Workload JSON with one request per line (readable, and diffable)."""
    reqs = ",\n  ".join(json.dumps(r) for r in workload["requests"])
    return f'{{"config": {json.dumps(workload["config"])},\n "requests": [\n  {reqs}]}}\n'


def write_case(folder: Path, workload: dict, ref: tuple[dict, list[dict]] | None, diffs: list[str]) -> None:
    """Save a failing case: the workload, both traces and the differences."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "workload.json").write_text(dump_workload(workload))
    (folder / "diff.txt").write_text("\n".join(diffs) + "\n")
    if ref is not None:
        header, steps = ref
        lines = [json.dumps({"header": header})] + [json.dumps(s) for s in steps]
        (folder / "vllm.jsonl").write_text("\n".join(lines) + "\n")
    with contextlib.suppress(*REJECTED):
        _, ours = run_ours(workload)
        (folder / "llmsched.jsonl").write_text("\n".join(json.dumps(s) for s in ours) + "\n")


# ---- commands ------------------------------------------------------------------


RunResult = tuple[tuple[dict, list[dict]] | None, str | None, list[str], set[str]]


def _run_one(pool: RefPool, workload: dict) -> RunResult:
    """(vLLM's trace or None, vLLM's error or None, differences, llmsched code paths)."""
    try:
        ref = pool.run(workload)
        err = None
    except RefError as e:
        ref, err = None, str(e)
    paths: set[str] = set()
    return ref, err, check_workload(workload, ref, err, paths), paths


def _confirm(pool: RefPool, workload: dict) -> list[str]:
    """Differences that survive a fresh vLLM process (rules out worker state)."""
    try:
        ref, err = run_ref_fresh(pool.ref_python, pool.driver, workload), None
    except RefError as e:
        ref, err = None, str(e)
    return check_workload(workload, ref, err)


def cmd_fuzz(args: argparse.Namespace) -> int:
    """Fuzz ``--count`` random workloads; save (and shrink) the failing ones."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)
    gen = Gen(rng, args.profile, args.mode, args.connector, args.hybrid, args.mm, args.scripts)
    cases = [gen.workload() for _ in range(args.count)]
    pool = RefPool(args.jobs, args.ref_python, args.driver)
    mixes: Counter[str] = Counter()
    feats: Counter[str] = Counter()
    failures = 0
    ref_errors = 0
    unfinished = 0
    t0 = time.time()
    try:
        with ThreadPoolExecutor(args.jobs) as ex:
            results = ex.map(lambda c: _run_one(pool, c[0]), cases)
            for k, ((wl, gfeats), (ref, err, diffs, paths)) in enumerate(zip(cases, results)):
                mixes[mix_key(wl)] += 1
                for x in features(wl, ref[1] if ref else None) | gfeats | paths:
                    feats[x] += 1
                if err is not None:
                    ref_errors += 1
                elif sum(len(st["finished"]) for st in ref[1]) != num_answers(wl):
                    # Not a mismatch by itself, but a workload vLLM cannot finish is suspect.
                    unfinished += 1
                    print(f"[{k}] vLLM left requests unfinished ({mix_key(wl)})", flush=True)
                if diffs:
                    diffs = _confirm(pool, wl)
                if diffs:
                    failures += 1
                    folder = out / f"fail-s{args.seed}-{k:05d}"
                    write_case(folder, wl, ref, diffs)
                    print(f"[{k}] MISMATCH ({mix_key(wl)}): {diffs[0]}  -> {folder}", flush=True)
                    if args.shrink:
                        small = shrink(wl, lambda w: bool(_run_one(pool, w)[2]))
                        sref, _, sd, _ = _run_one(pool, small)
                        write_case(folder / "shrunk", small, sref, sd)
                        print(f"    shrunk to {len(small['requests'])} requests: {sd[:1]}", flush=True)
                if (k + 1) % 50 == 0:
                    print(
                        f"{k + 1}/{args.count} done, {failures} mismatches, {time.time() - t0:.0f} s",
                        flush=True,
                    )
    finally:
        pool.close()
    report = {
        "seed": args.seed,
        "count": args.count,
        "mode": args.mode,
        "mismatches": failures,
        "ref_errors": ref_errors,
        "ref_unfinished": unfinished,
        "seconds": round(time.time() - t0, 1),
        "features": dict(sorted(feats.items())),
        "mixes": dict(sorted(mixes.items())),
    }
    (out / f"report-s{args.seed}.json").write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "mixes"}, indent=1))
    print(f"{len(mixes)} distinct knob mixes; report in {out / f'report-s{args.seed}.json'}")
    return 1 if failures else 0


def cmd_check(args: argparse.Namespace) -> int:
    """Compare llmsched and vLLM on the given workload files; mismatches are confirmed afresh."""
    bad = 0
    pool = RefPool(1, args.ref_python, args.driver)
    try:
        for path in args.workloads:
            wl = json.loads(Path(path).read_text())
            diffs = _run_one(pool, wl)[2]
            if diffs:
                diffs = _confirm(pool, wl)
            print(f"{path}: {'OK' if not diffs else 'MISMATCH'}")
            for d in diffs:
                print(f"    {d}")
            bad += bool(diffs)
    finally:
        pool.close()
    return 1 if bad else 0


def _steps_cost(steps: list[dict]) -> int:
    return len(steps) + sum(len(s["sched"]) for s in steps)


def choose_corpus(
    cands: list[tuple[dict, set[str], list[dict]]], size: int, rng: random.Random, want: int = 4
) -> list[int]:
    """Indices of ``size`` cases: every feature covered ``want`` times where possible, then random fill."""
    cover: Counter[str] = Counter()
    chosen: list[int] = []
    left = set(range(len(cands)))
    universe = set().union(*(c[1] for c in cands)) if cands else set()
    while len(chosen) < size and left:
        missing = {f for f in universe if cover[f] < want}
        if not missing:
            break
        best = max(
            left,
            key=lambda i: (len(cands[i][1] & missing), -_steps_cost(cands[i][2]), -i),
        )
        if not cands[best][1] & missing:
            break
        chosen.append(best)
        left.discard(best)
        cover.update(cands[best][1])
    rest = sorted(left)
    rng.shuffle(rest)
    chosen.extend(rest[: max(0, size - len(chosen))])
    return sorted(chosen)


def _record(name: str, wl: dict, ref: tuple[dict, list[dict]], feats: set[str], **extra: object) -> dict:
    """One corpus case: the workload, what it exercises, and vLLM's compact steps."""
    return {
        "name": name,
        **extra,
        "features": sorted(feats),
        "workload": wl,
        "steps": compact_steps(ref[1]),
        # Recorded with vLLM's preemption order (tools/drive_vllm.py), not sorted.
        "preempt_order": True,
    }


def cmd_corpus(args: argparse.Namespace) -> int:
    """Fuzz workloads and keep a feature-covering subset (plus --include cases) as a corpus file."""
    rng = random.Random(args.seed)
    gen = Gen(rng, args.profile, args.mode, args.connector, args.hybrid, args.mm, args.scripts)
    generated = [gen.workload() for _ in range(args.count)]
    included: list[tuple[str, dict]] = []
    for inc in args.include or []:
        p = Path(inc)
        files = sorted(p.rglob("*.json")) if p.is_dir() else [p]
        included.extend(
            (f.stem if f.stem != "workload" else f.parent.name, json.loads(f.read_text())) for f in files
        )
    pool = RefPool(args.jobs, args.ref_python, args.driver)
    records = []
    mism = inc_mism = 0
    try:
        with ThreadPoolExecutor(args.jobs) as ex:
            gen_res = list(ex.map(lambda c: _run_one(pool, c[0]), generated))
            inc_res = list(ex.map(lambda c: _run_one(pool, c[1]), included))
        for (name, wl), (ref, err, diffs, paths) in zip(included, inc_res):
            if ref is None:
                print(f"{name}: vLLM refused it ({err}); not included", flush=True)
                continue
            print(f"{name}: {'MISMATCH ' + diffs[0] if diffs else 'agrees'}", flush=True)
            inc_mism += bool(diffs)
            feats = features(wl, ref[1]) | paths
            records.append(_record(name, wl, ref, feats, mismatch_when_found=bool(diffs)))
        cands = []
        names = []
        failing: set[int] = set()
        for k, ((wl, gfeats), (ref, _, diffs, paths)) in enumerate(zip(generated, gen_res)):
            if ref is None:
                continue
            if args.connector != "off" and sum(len(st["finished"]) for st in ref[1]) != num_answers(wl):
                continue  # a script that never finishes (in vLLM too) cannot be replayed to its end
            if diffs:
                # Every mismatch is kept, whatever its size.
                mism += 1
                failing.add(len(cands))
                print(f"generated case {k} MISMATCH: {diffs[0]}", flush=True)
            elif (args.max_steps is not None and len(ref[1]) > args.max_steps) or (
                args.max_case_bytes is not None
                and len(json.dumps(wl)) + len(json.dumps(compact_steps(ref[1]))) > args.max_case_bytes
            ):
                continue  # only with --max-steps / --max-case-bytes: long traces are kept by default
            cands.append((wl, features(wl, ref[1]) | gfeats | paths, ref[1]))
            kind = "" if args.connector == "off" else "kv-"
            kind += "" if args.hybrid == "off" else "hy-"
            kind += "" if args.mm == "off" else "mm-"
            names.append(f"{kind}{args.profile}-s{args.seed}-{k:05d}")
        picked = sorted(set(choose_corpus(cands, args.size, random.Random(args.seed), args.cover)) | failing)
        for i in picked:
            wl, feats, steps = cands[i]
            extra = {"mismatch_when_found": True} if i in failing else {}
            records.append(_record(names[i], wl, ({}, steps), feats, **extra))
        if args.witnesses:
            # A minimal workload per llmsched decision path: the smallest
            # regression test that still walks that path.
            all_paths = sorted({f for c in cands for f in c[1] if f.startswith("path:")})
            for path in all_paths:
                i = min(
                    (i for i, c in enumerate(cands) if path in c[1]), key=lambda i: _steps_cost(cands[i][2])
                )

                def walks(w: dict, path: str = path) -> bool:
                    paths: set[str] = set()
                    try:
                        run_ours(w, paths)
                    except REJECTED:
                        return False
                    return path in paths

                small = shrink(cands[i][0], walks)
                ref, err, diffs, paths = _run_one(pool, small)
                if ref is None:
                    continue
                if diffs:
                    mism += 1
                    print(f"witness {path} MISMATCH: {diffs[0]}", flush=True)
                # Names stay unique across corpus files of both modes.
                mode = "" if args.mode == "sync" else f"{args.mode}-"
                mode += ("" if args.connector == "off" else "kv-") + ("" if args.mm == "off" else "mm-")
                name = f"witness-{mode}" + path.removeprefix("path:")
                records.append(_record(name, small, ref, features(small, ref[1]) | paths))
                print(f"{name}: {len(small['requests'])} requests, {len(ref[1])} steps", flush=True)
    finally:
        pool.close()
    vllm_version = gen_res[0][0][0].get("vllm_version") if gen_res and gen_res[0][0] else None
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    head = {
        "vllm_version": vllm_version,
        "seed": args.seed,
        "count": args.count,
        "profile": args.profile,
        "mode": args.mode,
        "connector": args.connector,
        "mm": args.mm,
    }
    with gzip.open(out, "wt", compresslevel=9) as f:
        f.write(json.dumps({"header": head}) + "\n")
        for rec in records:
            f.write(json.dumps(rec, separators=(",", ":")) + "\n")
    cover: Counter[str] = Counter()
    for rec in records:
        cover.update(rec["features"])
    print(json.dumps(dict(sorted(cover.items())), indent=1))
    print(
        f"{len(records)} cases ({len(included)} included, {len(picked)} generated of {len(cands)}), "
        f"{mism} mismatches among generated cases, {inc_mism} among included ones, "
        f"{out.stat().st_size} bytes -> {out}"
    )
    return 1 if mism or inc_mism else 0


def cmd_rerecord(args: argparse.Namespace) -> int:
    """Record vLLM's trace of every case of corpus files again, in place, with the driver's current fields."""
    bad = 0
    pool = RefPool(args.jobs, args.ref_python, args.driver)
    try:
        for path in map(Path, args.corpora):
            t0 = time.time()
            with gzip.open(path, "rt") as f:
                lines = [json.loads(line) for line in f if line.strip()]
            head, cases = lines[0], lines[1:]
            with ThreadPoolExecutor(args.jobs) as ex:
                results = list(ex.map(lambda c: _run_one(pool, c["workload"]), cases))
            kept = []
            for case, (ref, err, diffs, _) in zip(cases, results):
                if ref is None:
                    bad += 1
                    print(
                        f"{path.name} {case['name']}: vLLM refused it now ({err}); kept as it was", flush=True
                    )
                    kept.append(case)
                    continue
                if diffs:
                    # Kept as it was: a new trace llmsched disagrees with is for
                    # a person to look at, not for the corpus.
                    bad += 1
                    print(f"{path.name} {case['name']}: MISMATCH {diffs[0]}; kept as it was", flush=True)
                    kept.append(case)
                    continue
                kept.append({**case, "steps": compact_steps(ref[1]), "preempt_order": True})
            if results and results[0][0] is not None:
                head["header"]["vllm_version"] = results[0][0][0].get("vllm_version")
            with gzip.open(path, "wt", compresslevel=9) as f:
                f.write(json.dumps(head) + "\n")
                for rec in kept:
                    f.write(json.dumps(rec, separators=(",", ":")) + "\n")
            print(f"{path}: {len(kept)} cases recorded again in {time.time() - t0:.0f} s", flush=True)
    finally:
        pool.close()
    return 1 if bad else 0


COMMANDS = ("fuzz", "check", "corpus", "rerecord")


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; with no command given, ``fuzz`` is meant."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or (argv[0] not in COMMANDS and argv[0] not in ("-h", "--help")):
        argv.insert(0, "fuzz")
    ref = argparse.ArgumentParser(add_help=False)
    ref.add_argument("--ref-python", default=DEFAULT_REF_PYTHON, help="Python interpreter that has vLLM")
    ref.add_argument("--driver", default=DEFAULT_DRIVER, help="path of vLLM's drive_vllm.py")
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("fuzz", parents=[ref], help="fuzz random workloads (the default command)")
    f.add_argument("--seed", type=int, default=0)
    f.add_argument("--count", type=int, default=100, help="random workloads to check")
    f.add_argument("--jobs", type=int, default=2, help="vLLM worker processes")
    f.add_argument("--out", default="/tmp/parity_fuzz", help="where failing cases and the report go")
    f.add_argument("--shrink", action="store_true", help="shrink every failing workload")
    f.add_argument("--profile", choices=Gen.PROFILES, default="mixed", help="workload sizes")
    f.add_argument("--mode", choices=Gen.MODES, default="mixed", help="sync or async scheduling, or both")
    f.add_argument("--connector", choices=Gen.CONNECTOR, default="off", help="a scripted KV connector")
    f.add_argument("--hybrid", choices=Gen.HYBRID, default="off", help="Mamba models, sessions, or both")
    f.add_argument("--mm", choices=Gen.MM, default="off", help="encoder inputs (images) in prompts")
    f.add_argument("--scripts", choices=Gen.SCRIPTS, default="off", help="drafts, grammar waits, LoRA, stops")
    c = sub.add_parser("check", parents=[ref], help="compare on given workload files")
    c.add_argument("workloads", nargs="+")
    k = sub.add_parser("corpus", parents=[ref], help="build a regression corpus file")
    k.add_argument("--seed", type=int, default=2024)
    k.add_argument("--count", type=int, default=1500, help="workloads to generate and record")
    k.add_argument("--profile", choices=Gen.PROFILES, default="small", help="workload sizes")
    k.add_argument("--mode", choices=Gen.MODES, default="sync", help="sync or async scheduling, or both")
    k.add_argument("--connector", choices=Gen.CONNECTOR, default="off", help="a scripted KV connector")
    k.add_argument("--hybrid", choices=Gen.HYBRID, default="off", help="Mamba models, sessions, or both")
    k.add_argument("--mm", choices=Gen.MM, default="off", help="encoder inputs (images) in prompts")
    k.add_argument("--scripts", choices=Gen.SCRIPTS, default="off", help="drafts, grammar waits, LoRA, stops")
    k.add_argument("--cover", type=int, default=4, help="cases wanted per feature before random fill")
    k.add_argument("--size", type=int, default=300, help="generated cases to keep")
    k.add_argument(
        "--max-steps", type=int, default=None, help="skip cases with longer traces (default: keep all)"
    )
    k.add_argument(
        "--max-case-bytes",
        type=int,
        default=None,
        help="skip cases larger than this as JSON (default: keep all)",
    )
    k.add_argument("--jobs", type=int, default=2, help="vLLM worker processes")
    k.add_argument("--include", nargs="*", help="workload files or folders to include whatever they do")
    k.add_argument("--witnesses", action="store_true", help="add a shrunk minimal case per decision path")
    k.add_argument("--out", default=str(REPO / "tests" / "data" / "parity_fuzz" / "corpus-small.jsonl.gz"))
    r = sub.add_parser("rerecord", parents=[ref], help="record the vLLM traces of corpus files again")
    r.add_argument("corpora", nargs="+", help="corpus files (.jsonl.gz), rewritten in place")
    r.add_argument("--jobs", type=int, default=2, help="vLLM worker processes")
    args = ap.parse_args(argv)
    return {"fuzz": cmd_fuzz, "check": cmd_check, "corpus": cmd_corpus, "rerecord": cmd_rerecord}[args.cmd](
        args
    )


if __name__ == "__main__":
    sys.exit(main())
