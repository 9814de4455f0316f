"""Client workers released together: the concurrency suites' clock.

Each worker runs in its own thread and waits for one release event, so that the clock starts
when all of them are free to send (the seed's makespan start) and stops when the last one has
read its final response. A worker's exception is re-raised in the caller after all have ended.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence


def release(workers: Sequence[Callable[[], None]]) -> float:
    """Run `workers` in threads released at once; seconds from the release until the last
    one returns."""
    go = threading.Event()
    errors: list[BaseException] = []

    def body(work: Callable[[], None]) -> None:
        go.wait()
        try:
            work()
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            errors.append(e)

    # daemon threads: a Ctrl-C in the caller must not wait for requests in flight
    threads = [threading.Thread(target=body, args=(w,), daemon=True) for w in workers]
    for t in threads:
        t.start()
    start = time.perf_counter()
    go.set()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - start
    if errors:
        raise errors[0]
    return elapsed
