"""The once-an-interval rule shared by kvconn's repeated warnings."""

from __future__ import annotations

import threading

import pytest

from kvconn.lograte import LogInterval


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_repeated_warning_is_due_first_then_once_an_interval():
    clock = Clock()
    every = LogInterval(60.0, clock=clock)
    assert every.due()
    assert not every.due()
    clock.now += 59.9
    assert not every.due()
    clock.now += 0.1  # 60 s after the first
    assert every.due()
    clock.now += 30.0  # the interval counts from the last one logged, not the first
    assert not every.due()
    clock.now += 30.0
    assert every.due()


def test_an_interval_of_zero_logs_every_time():
    every = LogInterval(0.0, clock=Clock())
    assert all(every.due() for _ in range(5))


@pytest.mark.parametrize("bad", [-1.0, float("nan")])
def test_an_interval_that_is_not_a_duration_is_refused_by_name(bad):
    with pytest.raises(ValueError, match="interval_s must be >= 0"):
        LogInterval(bad)


def test_threads_asking_at_once_get_one_line_between_them():
    every = LogInterval(3600.0)
    start = threading.Barrier(8)
    answers: list[bool] = []

    def ask() -> None:
        start.wait()
        answers.extend(every.due() for _ in range(100))

    threads = [threading.Thread(target=ask) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert answers.count(True) == 1 and len(answers) == 800
