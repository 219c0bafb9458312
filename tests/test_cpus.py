"""CPU lists as taskset writes them, and pinning a process's threads (despina/cpus.py)."""
from __future__ import annotations

import os
import threading

import pytest

from despina import cpus


@pytest.mark.parametrize(("text", "expected"), [
    ("0", {0}), ("0-3,8", {0, 1, 2, 3, 8}), ("2, 0", {0, 2}), ("1-1", {1}), ("0-2,1-3", {0, 1, 2, 3}),
])
def test_parse(text: str, expected: set[int]) -> None:
    assert cpus.parse(text) == expected


@pytest.mark.parametrize("text", ["", "a", "-1", "1-", "1--2", "0,,1", "3-1", "1.5", "\u00b2", "0-\u00b2"])
def test_parse_refuses_what_is_not_a_cpu_list(text: str) -> None:
    with pytest.raises(cpus.CpuListError):
        cpus.parse(text)


@pytest.mark.parametrize(("cpus_", "text"), [({0}, "0"), ({0, 1, 2, 3, 8}, "0-3,8"), ({5, 7, 8}, "5,7-8")])
def test_format_list_is_the_inverse_of_parse(cpus_: set[int], text: str) -> None:
    assert cpus.format_list(cpus_) == text and cpus.parse(text) == cpus_


def test_check_names_what_is_missing() -> None:
    here = cpus.available()
    cpus.check(here)
    with pytest.raises(cpus.CpuListError, match=r"CPU 100000 is not available here \(this process may run on"):
        cpus.check(here | {100000})


def test_pin_moves_threads_already_running_and_those_started_later() -> None:
    here = cpus.available()
    one = frozenset({min(here)})
    started, stop = threading.Event(), threading.Event()
    seen: dict[str, frozenset[int]] = {}

    def early() -> None:
        started.set()
        stop.wait(10)
        seen["early"] = frozenset(os.sched_getaffinity(0))

    thread = threading.Thread(target=early)
    thread.start()
    started.wait(10)
    try:
        cpus.pin(one)
        late = threading.Thread(target=lambda: seen.__setitem__("late", frozenset(os.sched_getaffinity(0))))
        late.start(), late.join()
        stop.set(), thread.join()
        assert seen == {"early": one, "late": one} and cpus.available() == one
    finally:
        cpus.pin(here)
