"""Exact rollback of the GDN state after a partial acceptance, by per-position state slots.

A speculative request holds its own GDN state slot and K extra ones (specdecode.md C.1). Its
verify segment [x, d1..dK] runs recurrently and leaves the state after token i in
extra[i] (i < K) and the state after the last token in its own slot, reading but never
overwriting the state it started from. Accepting a drafts makes the state after token a
current: it already sits in a slot, so rollback is an exchange of slot ids (no copy, no
recomputation). Conv windows live in the same slots and roll back with the recurrent state.
Attention K/V needs nothing: the sequence's length decides what is read, and the rejected
positions are overwritten by the next verify.
"""

from __future__ import annotations

from ninfer_runtime.engine.request_state import RequestState


def snapshot_slots(state: RequestState, num_tokens: int) -> list[int]:
    """The slot that receives the GDN state after each of a verify segment's tokens."""
    assert state.slot is not None and len(state.extra_slots) >= num_tokens - 1
    return [*state.extra_slots[:num_tokens - 1], state.slot]


def keep_state_after(state: RequestState, row: int, num_tokens: int) -> None:
    """Make the state after row `row` of the request's verify segment of `num_tokens` tokens
    its current state."""
    assert state.slot is not None and 0 <= row < num_tokens
    if row < num_tokens - 1:
        state.slot, state.extra_slots[row] = state.extra_slots[row], state.slot
