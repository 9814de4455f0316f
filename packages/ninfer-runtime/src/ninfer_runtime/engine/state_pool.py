"""The GDN state pool: conv windows and fp32 recurrent states, one slot per running request.

Storage is one `GDNSlots` per GDN layer (models.cache), all with the same number of slots; slot
i of a request means slot i in every layer. The allocator is not tied to requests: besides a
running request's own slot it can hand out extra slots, which is what state snapshots need
(prefix reuse at chunk boundaries, per-draft-position states for speculative rollback).
"""

from __future__ import annotations

from collections.abc import Sequence

from ninfer_runtime.models.cache import GDNSlots


class OutOfSlotsError(RuntimeError):
    """A slot asked for when none is free (the scheduler checks first, so this is a bug)."""


class SlotAllocator:
    """Slot ids 0 .. num_slots-1. Pure Python, no tensors."""

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # pop() hands out low ids first
        self._used = [False] * num_slots

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise OutOfSlotsError(f"all {self.num_slots} state slots are in use")
        slot = self._free.pop()
        self._used[slot] = True
        return slot

    def release(self, slot: int) -> None:
        if not self._used[slot]:
            raise ValueError(f"state slot {slot} is already free")
        self._used[slot] = False
        self._free.append(slot)


class StatePool:
    """The GDN layers' `GDNSlots` storage (same slot count in each) and its allocator."""

    def __init__(self, layers: Sequence[GDNSlots]):
        if not layers or len({s.conv.shape[0] for s in layers}) != 1:
            raise ValueError("a state pool needs GDN layers with equal slot counts")
        self.layers = tuple(layers)
        self.allocator = SlotAllocator(layers[0].conv.shape[0])

    @property
    def num_slots(self) -> int:
        return self.allocator.num_slots

    def allocate(self) -> int:
        """A free slot, zeroed: the state of an empty sequence."""
        slot = self.allocator.allocate()
        for layer in self.layers:
            layer.reset(slot)
        return slot

    def release(self, slot: int) -> None:
        self.allocator.release(slot)

    def copy(self, src: int, dst: int) -> None:
        """Snapshot slot `src` into slot `dst` (both allocated) in every GDN layer."""
        for layer in self.layers:
            layer.copy(src, dst)
