"""The save policy and Checkpointer, driven by a fake clock: timer saves, keep steps, pruning temporaries."""

import io
from datetime import timedelta

import numpy as np
import pytest

import dist_ckpt
from dist_ckpt.policy import Decision, SavePolicy, parse_keep
from dist_ckpt.progress import ProgressLine


class FakeClock:
    """A clock the test moves by hand."""

    def __init__(self, now: float = 0.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_keep_policies_make_permanent_steps_until_their_limit():
    clock = FakeClock()
    policy = SavePolicy(
        save_interval=None, keep=[{"every": 3, "until": 9}, {"every": 10}], clock=clock, last_saved_step=None
    )
    saved = [step for step in range(1, 31) if policy.decide(step).save]
    assert saved == [3, 6, 9, 10, 20, 30]


def test_timer_saves_are_temporary_and_restart_at_every_save():
    clock = FakeClock()
    policy = SavePolicy(save_interval=timedelta(minutes=10), keep=[{"every": 100}], clock=clock)
    decisions = {}
    for step in range(1, 201):
        clock.now = step * 60.0  # one minute a step
        decisions[step] = policy.decide(step)
    saved = {step: d.temporary for step, d in decisions.items() if d.save}
    # Timer at 10, 20, ... minutes; the permanent save at 100 restarts the timer, which then fires at 110.
    assert saved == {
        **{s: True for s in range(10, 100, 10)},
        100: False,
        **{s: True for s in range(110, 200, 10)},
        200: False,
    }


def test_a_step_already_saved_is_not_saved_again():
    clock = FakeClock()
    policy = SavePolicy(save_interval=timedelta(seconds=1), keep=[{"every": 5}], clock=clock, last_saved_step=5)
    clock.now = 100.0
    assert policy.decide(5) == Decision(save=False)  # just resumed from step 5
    assert policy.decide(6) == Decision(save=True, temporary=True)
    assert policy.decide(6, force=True) == Decision(save=False)


@pytest.mark.parametrize(
    ("keep", "message"),
    [
        ([{"every": 0}], r"keep\[0\]: 'every' must be a positive integer"),
        ([{"every": 5}, {"evry": 5}], r"keep\[1\] = \{'evry': 5\} is not a keep policy"),
        ([{"every": 5, "until": "10"}], r"keep\[0\]: 'until' must be an integer step"),
        ([5], r"keep\[0\] = 5 is not a keep policy"),
    ],
)
def test_bad_keep_entries_are_named(keep, message):
    with pytest.raises(ValueError, match=message):
        parse_keep(keep)


def test_non_positive_interval_is_refused():
    with pytest.raises(ValueError, match="save_interval must be positive"):
        SavePolicy(save_interval=timedelta(0), keep=[], clock=FakeClock())


def state(step):
    return {"w": np.full(4, step, np.float32), "step": step}


def test_checkpointer_deletes_a_temporary_once_the_next_is_complete(tmp_path):
    clock = FakeClock()
    checkpointer = dist_ckpt.Checkpointer(
        tmp_path, save_interval=timedelta(seconds=30), keep=[{"every": 10}], clock=clock, progress=False
    )
    saved = []
    for step in range(1, 26):
        clock.now = step * 7.0
        if checkpointer.on_step(state(step), step):
            saved.append(step)
            checkpointer.wait()
            steps_on_disk = [info.step for info in dist_ckpt.list_checkpoints(tmp_path)]
            temporaries = [i.step for i in dist_ckpt.list_checkpoints(tmp_path) if i.temporary]
            assert temporaries in ([], [step]), f"after saving {step}: {steps_on_disk}"
    checkpointer.wait()
    assert saved == [5, 10, 15, 20, 25]  # timer (30 s at 7 s a step) at 5, 15, 25; keep at 10, 20
    infos = dist_ckpt.list_checkpoints(tmp_path)
    assert [(i.step, i.temporary) for i in infos] == [(10, False), (20, False), (25, True)]
    assert checkpointer.latest() == tmp_path / "step-25"
    loaded = dist_ckpt.load(checkpointer.latest(), state(0))
    assert loaded["step"] == 25 and loaded["w"].tolist() == [25.0] * 4


def test_resumed_checkpointer_does_not_resave_its_step_and_prunes_the_old_temporary(tmp_path):
    clock = FakeClock()
    first = dist_ckpt.Checkpointer(tmp_path, save_interval=timedelta(seconds=5), clock=clock, progress=False)
    clock.now = 10.0
    assert first.on_step(state(3), 3)
    first.wait()

    resumed = dist_ckpt.Checkpointer(tmp_path, save_interval=timedelta(seconds=5), clock=clock, progress=False)
    step = dist_ckpt.load(resumed.latest(required=True), state(0))["step"]
    clock.now = 100.0
    assert not resumed.on_step(state(step), step)  # the step it resumed from is on disk already
    assert resumed.on_step(state(4), 4)
    resumed.wait()
    assert [(i.step, i.temporary) for i in dist_ckpt.list_checkpoints(tmp_path)] == [(4, True)]


def test_forced_save_is_permanent(tmp_path):
    checkpointer = dist_ckpt.Checkpointer(tmp_path, save_interval=None, clock=FakeClock(), progress=False)
    assert not checkpointer.on_step(state(1), 1)
    assert checkpointer.on_step(state(2), 2, force=True)
    checkpointer.wait()
    assert [(i.step, i.temporary) for i in dist_ckpt.list_checkpoints(tmp_path)] == [(2, False)]


def test_progress_line_reports_rate_and_eta_only_for_slow_work():
    clock, out = FakeClock(), io.StringIO()
    line = ProgressLine("saving step-9", 4 * 2**30, interval=5.0, stream=out, clock=clock)
    clock.now = 1.0
    line.update(2**30)
    assert out.getvalue() == ""  # quick work prints nothing
    clock.now = 8.0
    line.update(2 * 2**30)
    clock.now = 16.0
    line.finish()
    lines = out.getvalue().splitlines()
    assert lines[0] == "dist_ckpt: saving step-9: 2.00 GiB / 4.00 GiB (50%), 256 MiB/s, ETA 8 s"
    assert lines[1] == "dist_ckpt: saving step-9: done, 4.00 GiB in 16.0 s (256 MiB/s)"


def test_a_stopping_jobs_save_is_temporary_unless_kept_and_the_next_checkpoint_replaces_it(tmp_path):
    clock = FakeClock()
    stopping = dist_ckpt.Checkpointer(tmp_path, save_interval=timedelta(hours=1), keep=[{"every": 2}], clock=clock)
    assert stopping.on_step(state(2), 2)  # kept by the policy
    assert stopping.on_step(state(3), 3, force_temporary=True)  # a signal after step 3: saved now, not kept
    stopping.wait()
    assert [(i.step, i.temporary) for i in dist_ckpt.list_checkpoints(tmp_path)] == [(2, False), (3, True)]

    rerun = dist_ckpt.Checkpointer(tmp_path, save_interval=timedelta(hours=1), keep=[{"every": 2}], clock=clock)
    assert rerun.on_step(state(4), 4, force_temporary=True)  # on a kept step it is permanent
    rerun.wait()
    assert [(i.step, i.temporary) for i in dist_ckpt.list_checkpoints(tmp_path)] == [(2, False), (4, False)]
    assert rerun.on_step(state(5), 5, force=True)  # the end of a run: permanent whatever the policy
    rerun.wait()
    assert [(i.step, i.temporary) for i in dist_ckpt.list_checkpoints(tmp_path)] == [(2, False), (4, False), (5, False)]


def test_an_agreed_decision_saves_as_on_step_would_and_prunes_the_same(tmp_path):
    clock = FakeClock()
    checkpointer = dist_ckpt.Checkpointer(
        tmp_path, save_interval=timedelta(seconds=30), keep=[{"every": 4}], clock=clock, progress=False
    )
    saved = []
    for step in range(1, 10):
        clock.now = step * 20.0
        decision = checkpointer.policy.decide(step)  # process 0's, which a caller shares with every process
        if checkpointer.on_agreed_step(state(step), step, decision):
            saved.append((step, decision.temporary))
            checkpointer.wait()
    # The timer (30 s at 20 s a step) at 2 and 6, keep at 4 and 8; at 9 only 20 s have passed since 8.
    assert saved == [(2, True), (4, False), (6, True), (8, False)]
    assert not checkpointer.on_agreed_step(state(9), 9, Decision(save=False))
    assert [(i.step, i.temporary) for i in dist_ckpt.list_checkpoints(tmp_path)] == [(4, False), (8, False)]
    assert checkpointer.on_agreed_step(state(9), 9, Decision(save=True, temporary=True))
    checkpointer.wait()
    infos = dist_ckpt.list_checkpoints(tmp_path)
    assert [(i.step, i.temporary) for i in infos] == [(4, False), (8, False), (9, True)]
    assert dist_ckpt.load(checkpointer.latest(), state(0))["step"] == 9
