"""Where the GPU idles between decode steps, from the device's own timeline.

A graphed decode step takes longer than its graph replayed back to back (the engine bench's
ms/step against its graph replay ms): by the work the step does outside the replay (input
copies, sampling, the tokens' copy back) and by the time the GPU waits for the host. The
profiler (CUPTI) records every kernel and copy with its device start and end, a graph's
kernels included; the union of those intervals is the time the GPU was busy, and each gap
between them, named by the activity that ended before it and the one that started after it,
says what the GPU waited between. The activities that run at most twice a step (the copies
and the sampling beside a graph replay, the lm_head; not the layers' kernels) are listed with
their own time, which the step spends busy but outside the layers.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Gap:
    """Idle intervals between the same two activities, summed over the timeline."""

    before: str  # the activity that ended last before the gap
    after: str  # the activity that started at its end
    count: int
    us: float


@dataclass(frozen=True)
class Activity:
    """One kind of device activity (a kernel or copy name), summed over the timeline."""

    name: str
    count: int
    us: float


@dataclass(frozen=True)
class Timeline:
    steps: int
    span_us: float  # the first activity's start to the last one's end
    busy_us: float  # the union of the activities' intervals
    gaps: list[Gap]  # idle intervals of at least the threshold, largest total first (ties by name)
    rare: list[Activity]  # those at most twice a step, longest total first (ties by name)

    @classmethod
    def from_dict(cls, found: dict) -> Timeline:
        """Back from a report's JSON (`dataclasses.asdict`)."""
        return cls(**{**found, "gaps": [Gap(**g) for g in found["gaps"]],
                      "rare": [Activity(**a) for a in found.get("rare", [])]})

    @property
    def step_us(self) -> float:
        return self.span_us / self.steps

    @property
    def idle_us_a_step(self) -> float:
        return (self.span_us - self.busy_us) / self.steps


def timeline(activities: Sequence[tuple[str, float, float]], steps: int,
             min_gap_us: float = 1.0) -> Timeline:
    """The timeline of device activities (name, start us, end us) over `steps` steps; gaps
    shorter than min_gap_us (a launch's own latency) count as idle but are not listed."""
    if not activities:
        raise ValueError("no device activity was recorded")
    kinds = defaultdict(lambda: [0, 0.0])
    for name, s, e in activities:
        kinds[name][0] += 1
        kinds[name][1] += e - s
    rare = sorted((Activity(name, n, us) for name, (n, us) in kinds.items() if n <= 2 * steps),
                  key=lambda a: (-a.us, a.name))
    ordered = sorted(activities, key=lambda a: a[1])
    busy, gaps = 0.0, defaultdict(lambda: [0, 0.0])
    last_name, start, end = ordered[0]
    for name, s, e in ordered[1:]:
        if s > end:
            busy += end - start
            if s - end >= min_gap_us:
                gap = gaps[(last_name, name)]
                gap[0] += 1
                gap[1] += s - end
            start, end, last_name = s, e, name
        elif e > end:
            end, last_name = e, name
    busy += end - start
    listed = [Gap(before, after, n, us) for (before, after), (n, us) in gaps.items()]
    return Timeline(steps, end - ordered[0][1], busy,
                    sorted(listed, key=lambda g: (-g.us, g.before, g.after)), rare)
