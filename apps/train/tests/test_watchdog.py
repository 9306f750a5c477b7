"""The watchdog's parts that need no hang: the automatic timeout, the stack dump, who is slow, its paragraph."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from lm_train.config import load_train_config
from lm_train.errors import ConfigError
from lm_train.run import watchdog as wd
from lm_train.run.watchdog import DECISION, DEVICE, HOST, SAVE, Watchdog, dump_stacks, hang_message, slow_hosts


def test_the_automatic_timeout_is_a_multiple_of_the_median_untimed_steps_left_out(monkeypatch, tmp_path):
    now = [100.0]
    monkeypatch.setattr(wd.time, "monotonic", lambda: now[0])
    dog = Watchdog(None, tmp_path, 0, 1)
    try:
        durations = [2.0] * 10 + [30.0] * 9 + [1.0]  # the median of the 20 timed steps is 2.0
        for step in (-1, 0):  # the first two steps are never timed: they wait for every host's compile
            now[0] += 1000.0
            dog.beat(step)
        dog.beat(1)
        for step, seconds in enumerate(durations, start=2):
            if step == 5:
                dog.excuse()  # an eval in step 5: steps 5 and 6 are not timed
                now[0] += 5000.0
                dog.beat(step)
                now[0] += 5000.0
                continue
            now[0] += seconds
            dog.beat(step)
            assert dog.timeout is None or step >= 23
        for step in range(23, 25):
            now[0] += 2.0
            dog.beat(step)
        assert dog.timeout == max(wd.AUTO_MULTIPLE * 2.0, wd.AUTO_FLOOR_S)
        assert dog.automatic
    finally:
        dog.close()


def test_off_starts_no_thread(tmp_path):
    before = {thread.name for thread in threading.enumerate()}
    dog = Watchdog.for_run(0, tmp_path, (0, 1))
    dog.beat(1)
    assert "lm-train watchdog" not in {thread.name for thread in threading.enumerate()} - before
    assert not (tmp_path / "hangs").exists()


def test_the_dump_holds_every_threads_stack(tmp_path):
    started, release = threading.Event(), threading.Event()

    def parked_in_a_known_place() -> None:
        started.set()
        release.wait(30)

    thread = threading.Thread(target=parked_in_a_known_place, name="parked")
    thread.start()
    started.wait(30)
    try:
        path = dump_stacks(tmp_path / "hangs" / "process-0-step-7.txt", 7, 12.5)
    finally:
        release.set()
        thread.join()
    text = path.read_text(encoding="utf-8")
    assert text.startswith("pid ") and "no step done for 12.5 s, at step 7" in text
    assert "--- thread parked (" in text and "in parked_in_a_known_place" in text
    assert "--- thread MainThread (" in text and "test_the_dump_holds_every_threads_stack" in text
    assert [p.name for p in path.parent.iterdir()] == ["process-0-step-7.txt"]  # no partial file left


def report(step: int, phase: str) -> dict:
    return {"step": step, "phase": phase, "late": 9.0}


@pytest.mark.parametrize(
    ("reports", "count", "expected"),
    [
        ({0: report(6, DEVICE), 1: report(5, HOST)}, 2, ([1], [])),  # a host busy with its own work
        ({0: report(6, SAVE), 1: report(5, HOST), 2: report(6, SAVE)}, 3, ([1], [])),
        ({0: report(6, SAVE), 1: report(6, DECISION)}, 2, ([0], [])),  # in a save: a storage hang
        ({0: report(7, DEVICE), 1: report(6, DEVICE), 2: report(7, DECISION)}, 3, ([1], [])),  # furthest behind
        ({0: report(6, DEVICE)}, 3, ([], [1, 2])),  # those that did not report
    ],
)
def test_slow_hosts(reports, count, expected):
    assert slow_hosts(reports, count) == expected


def test_the_paragraph_names_the_slow_host_the_dumps_and_the_fix():
    reports = {0: report(6, DEVICE), 1: report(5, HOST)}
    text = hang_message(6, 9.4, 8.0, False, reports, 2, Path("runs/x/hangs"))
    assert text == (
        "lm-train: the watchdog ended the run: no step was done for 9 s, at step 6 (trainer.watchdog.timeout_s: "
        "8 s). Slow: process 1 (busy with its own work at step 5). The others: process 0 (waiting for the device "
        "at step 6). Every thread's stack of each process is in runs/x/hangs/. The exit status is 75, so that a "
        "launcher restarts the run; the rerun resumes from the newest checkpoint. If steps this slow are "
        "expected, raise trainer.watchdog.timeout_s (0 turns the watchdog off)."
    )
    alone = hang_message(30, 400.0, 300.0, True, {0: report(30, DEVICE)}, 1, Path("h"))
    assert "(trainer.watchdog.timeout_s: 300 s, set from the median step time). It was waiting for the device." in alone


def test_a_negative_timeout_is_a_config_error(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("trainer:\n  watchdog:\n    timeout_s: -1\n", encoding="utf-8")
    with pytest.raises(ConfigError, match=r"trainer.watchdog.timeout_s must be a number of seconds, null"):
        load_train_config([config])
    config.write_text("trainer:\n  watchdog:\n    timeout_s: null\n", encoding="utf-8")
    assert load_train_config([config])[0].trainer.watchdog.timeout_s is None


def test_a_wait_for_data_is_excused_only_while_the_caches_are_built(tmp_path):
    dog = Watchdog(0, tmp_path, 0, 1)
    answers, said = [False, True], []

    def finished() -> bool:
        return answers.pop(0)  # a third read would fail: once finished, it is never read again

    on_wait = wd.data_wait(dog, finished, lambda: said.append("waiting"))
    on_wait()
    assert dog._excused and dog._excuse_next
    for step in range(1, 5):  # the two untimed steps, then this step's excuse and the next's
        dog.beat(step)
    assert not dog._excused
    on_wait()
    on_wait()
    assert not dog._excused and said == ["waiting"] * 3
