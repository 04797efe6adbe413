"""WatchedSteps alone (no Lightning): which windows are watched, where strict applies, and
which windows time the schedule, on a scripted clock and the CPU simulation."""

from __future__ import annotations

import pytest
import torch

from gpu_busy.syncs import SyncError
from gpu_busy.syncs.detector import SyncDetector
from gpu_busy.syncs.sampling import WatchSchedule
from gpu_busy.syncs.watched_steps import WatchedSteps


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def loop(steps: WatchedSteps, clock: Clock, logging: list[bool], work) -> list:
    """One epoch; ``work(i)`` is the step; each step takes 1 s of the scripted clock."""
    seen = []
    steps.epoch_starts()
    for i, log_now in enumerate(logging):
        steps.step_starts(logging=log_now)
        work(i)
        clock.now += 1.0
        seen.append(steps.step_ends(logging=log_now))
        steps.next_window()
    steps.epoch_ends()
    return seen


def test_strict_raises_only_in_a_steady_watched_step():
    x = torch.ones(3)  # device memory in the simulation
    clock = Clock()
    steps = WatchedSteps(SyncDetector("cpu"), WatchSchedule(first=10), strict=True, clock=clock)
    # A logging step and the one after it read back by design: counted, not raised.
    seen = loop(steps, clock, [True, False], lambda i: x.sum().item())
    assert [(len(events), steady) for events, steady in seen] == [(1, False), (1, False)]
    with pytest.raises(SyncError):
        loop(steps, clock, [False, False], lambda i: x.sum().item())
    steps.close()
    assert not steps.detector.active


def test_the_loop_work_after_a_step_is_strict_unless_the_step_logged_and_hooks_never_are():
    x = torch.ones(3)
    clock = Clock()
    steps = WatchedSteps(SyncDetector("cpu"), WatchSchedule(first=10), strict=True, clock=clock)
    steps.epoch_starts()
    steps.step_starts(logging=False)
    steps.step_ends(logging=True)
    steps.next_window()
    x.sum().item()  # after a logging step: the loop writes its metrics, allowed
    steps.step_starts(logging=False)  # right after a logging step: not steady either
    steps.step_ends(logging=False)
    steps.next_window()
    steps.hooks_begin()  # a callback's hooks (a save every N steps): never strict
    x.sum().item()
    steps.hooks_end()
    with pytest.raises(SyncError):
        x.sum().item()  # the loop's own work after a steady step: strict
    steps.close()


def test_only_clean_steady_windows_after_the_first_time_the_schedule():
    clock = Clock()
    schedule = WatchSchedule(first=2)
    observed = []
    schedule.observe = lambda watched, seconds: observed.append((watched, seconds))
    steps = WatchedSteps(SyncDetector("cpu"), schedule, clock=clock)
    loop(steps, clock, [False, False, True, False, False, False], lambda i: None)
    # window 0: set-up; 2: a logging step; 3: right after one; the epoch's first window
    # opens at its first step, so the rest are whole steps of 1 s.
    assert observed == [(True, 1.0), (False, 1.0), (False, 1.0)]
    steps.pause()  # validation between epochs leaves the next window unclean
    steps.resume()
    assert steps.steps == 6 and not steps.watching


def test_strict_says_the_fix_with_the_line():
    x = torch.ones(3)
    clock = Clock()
    steps = WatchedSteps(SyncDetector("cpu"), WatchSchedule(first=10), strict=True, clock=clock)
    with pytest.raises(SyncError, match=r"Tensor\.item\(\) at .*; fix: .+"):
        loop(steps, clock, [False, False], lambda i: x.sum().item())
    steps.close()
