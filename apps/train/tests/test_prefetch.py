"""The prefetcher yields every step once, in order, ends, and hands producer errors to the consumer."""

import threading

import pytest

from lm_train.data.prefetch import Prefetcher


def test_yields_each_step_in_order_and_stops():
    seen = list(Prefetcher(lambda step: step * 10, 3, 9, depth=2))
    assert seen == [(s, s * 10) for s in range(3, 9)]


def test_empty_range_ends_at_once():
    assert list(Prefetcher(lambda step: step, 5, 5)) == []


def test_producer_error_surfaces_in_the_consumer():
    def make(step):
        if step == 2:
            raise ValueError("bad shard")
        return step

    got = []
    with pytest.raises(ValueError, match="bad shard"):
        for _step, batch in Prefetcher(make, 0, 5):
            got.append(batch)
    assert got == [0, 1]


def test_close_stops_the_producer():
    started = threading.Event()

    def make(step):
        started.set()
        return step

    prefetch = Prefetcher(make, 0, 10_000, depth=1)
    started.wait(5)
    prefetch.close()
    prefetch._thread.join(5)
    assert not prefetch._thread.is_alive()


def test_eta_format():
    from lm_train.run.progress import format_duration

    assert [format_duration(s) for s in (0.4, 42, 185, 3720)] == ["0s", "42s", "3m05s", "1h02m"]
