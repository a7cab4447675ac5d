"""The executor's adapters: every registered one in host memory, at most ``max_loras`` in device slots.

``add`` (any thread) reads and checks a folder once, so a bad adapter fails
the request that names it, never a step. Steps run on the executor's
thread: ``prepare_step`` puts the step's adapters in slots, loading a
missing one on demand and evicting the least recently used adapter that the
step does not need. The scheduler never runs more than ``max_loras``
adapters in one step, so a free or evictable slot always exists.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

import torch

from llmsched.executor.torch.config import ModelConfig
from llmsched.executor.torch.lora.adapter import LoRAAdapter, load_adapter
from llmsched.executor.torch.lora.errors import LoRALoadError
from llmsched.executor.torch.lora.step import (
    LoRAStep,
    Span,
    StackedLoRAStep,
    StackedPair,
    group_rows,
    rows_tensor,
    stack_adapters,
)

# Steps of at most this many rows that mix adapters (or the base model) run
# the stacked products; larger ones the gathered ones (see step.py).
STACKED_MAX_ROWS = 512
# Stacked weights kept for this many sets of adapters.
_STACK_CACHE = 4


class LoRAManager:
    """Registered adapters (host) and the device slots; see the module docstring."""

    def __init__(
        self, cfg: ModelConfig, max_loras: int, max_rank: int, device: torch.device, dtype: torch.dtype
    ) -> None:
        for name, v in (("max_loras", max_loras), ("max_lora_rank", max_rank)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise LoRALoadError(f"{name}={v!r} must be a positive integer")
        self.cfg = cfg
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.device = device
        self.dtype = dtype
        # id -> adapter in host memory, in the model dtype.
        self._registered: dict[int, LoRAAdapter] = {}
        self._lock = threading.Lock()
        # id -> adapter on the device, least recently used first.
        self.slots: OrderedDict[int, LoRAAdapter] = OrderedDict()
        self.num_loads = 0
        self.num_evictions = 0
        # Set by remove(): the next step drops slots of adapters no longer registered.
        self._purge = False
        # Sorted adapter ids -> their stacked weights, least recently used first.
        self._stacks: OrderedDict[tuple[int, ...], list[list[StackedPair | None]]] = OrderedDict()

    def add(self, name: str, int_id: int, path: str) -> bool:
        """Register an adapter (read and checked now); False when this id is already registered as given."""
        with self._lock:
            have = self._registered.get(int_id)
        if have is not None:
            if have.name != name or str(have.path) != str(path):
                raise LoRALoadError(
                    f"lora_int_id {int_id} is already LoRA adapter {have.name!r} ({str(have.path)!r}); "
                    f"give {name!r} another id"
                )
            return False
        adapter = load_adapter(path, name, int_id, self.cfg, self.max_rank)
        adapter = adapter.to(torch.device("cpu"), self.dtype)
        with self._lock:
            self._registered[int_id] = adapter
        return True

    def remove(self, int_id: int) -> bool:
        """Forget an adapter (its slot is freed when next needed); False when it was not registered."""
        with self._lock:
            self._purge = True
            return self._registered.pop(int_id, None) is not None

    def registered(self) -> list[LoRAAdapter]:
        """The registered adapters, in registration order."""
        with self._lock:
            return list(self._registered.values())

    def prepare_step(self, spans: Sequence[Span], num_rows: int) -> LoRAStep | StackedLoRAStep:
        """Slot the step's adapters and index each one's rows (on the executor's thread)."""
        if self._purge:
            with self._lock:
                self._purge = False
                for lid in [k for k in self.slots if k not in self._registered]:
                    del self.slots[lid]
                    self._stacks.clear()
        by_id = group_rows(spans)
        if len(by_id) > self.max_loras:
            raise RuntimeError(
                f"a step runs {len(by_id)} adapters, more than max_loras={self.max_loras}; "
                "the scheduler and executor disagree on max_loras"
            )
        adapters = {lid: self._slot(lid, by_id) for lid in by_id}
        one_covers_all = len(by_id) == 1 and next(iter(by_id.values())) == [(0, num_rows)]
        if num_rows <= STACKED_MAX_ROWS and not one_covers_all:
            return self._stacked(by_id, adapters, num_rows)
        return LoRAStep(
            [(adapters[lid], rows_tensor(ranges, num_rows, self.device)) for lid, ranges in by_id.items()]
        )

    def _stacked(
        self, by_id: dict[int, list[tuple[int, int]]], adapters: dict[int, LoRAAdapter], num_rows: int
    ) -> StackedLoRAStep:
        key = tuple(sorted(by_id))
        stacked = self._stacks.get(key)
        if stacked is None:
            if len(self._stacks) >= _STACK_CACHE:
                self._stacks.popitem(last=False)
            stacked = self._stacks[key] = stack_adapters([adapters[lid] for lid in key])
        else:
            self._stacks.move_to_end(key)
        slot_of = {lid: k for k, lid in enumerate(key)}
        row_slot = [-1] * num_rows
        for start, end, lid in ((s, e, lid) for lid, ranges in by_id.items() for s, e in ranges):
            row_slot[start:end] = [slot_of[lid]] * (end - start)
        rows = torch.tensor(row_slot, dtype=torch.int64).to(self.device)
        return StackedLoRAStep(stacked, rows, self.dtype)

    def _slot(self, lid: int, needed: dict[int, object]) -> LoRAAdapter:
        slots = self.slots
        adapter = slots.get(lid)
        if adapter is not None:
            slots.move_to_end(lid)
            return adapter
        with self._lock:
            host = self._registered.get(lid)
        if host is None:
            raise KeyError(f"LoRA adapter id {lid} is scheduled but not registered with the executor")
        while len(slots) >= self.max_loras:
            victim = next(k for k in slots if k not in needed)
            del slots[victim]
            self.num_evictions += 1
            # Stacks holding the evicted adapter must not outlive its slot.
            for k in [k for k in self._stacks if victim in k]:
                del self._stacks[k]
        adapter = slots[lid] = host.to(self.device, self.dtype)
        self.num_loads += 1
        return adapter
