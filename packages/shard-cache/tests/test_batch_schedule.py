"""Batch-size schedules: offsets against a step-by-step count, and a mixture read under one against the same
mixture's stream at a fixed size (the same examples, cut differently)."""

import numpy as np
import pytest

from shard_cache import BatchSchedule, MixtureExhaustedError, MixtureLayout, mixture_examples, parse_train_weights

STAGES = [(0, 4), (3, 8), (5, 2), (9, 6)]


def sizes_by_step(stages, steps):
    """The size of each of `steps` steps, walked one step at a time (the stage in force is the last started)."""
    return [max((start, value) for start, value in stages if start <= step)[1] for step in range(steps)]


def test_offsets_sizes_and_steps_equal_a_step_by_step_count():
    schedule = BatchSchedule(STAGES)
    sizes = sizes_by_step(STAGES, 14)
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    assert [schedule.size_at(s) for s in range(14)] == sizes
    assert [schedule.offset(s) for s in range(15)] == offsets.tolist()
    for step in range(14):
        np.testing.assert_array_equal(schedule.positions(step), np.arange(offsets[step], offsets[step + 1]))
        for position in range(offsets[step], offsets[step + 1]):
            assert schedule.step_of(position) == step
    assert schedule.distinct_sizes == (2, 4, 6, 8) and schedule.largest == 8 and schedule.fixed is None
    fixed = BatchSchedule(5)
    assert fixed.fixed == 5 and fixed.offset(7) == 35 and fixed.step_of(34) == 6 and fixed == BatchSchedule([(0, 5)])


@pytest.mark.parametrize(
    ("stages", "message"),
    [
        ([], "at least one stage"),
        ([(1, 4)], "first stage must start at step 0"),
        ([(0, 4), (3, 8), (3, 2)], "stage 2 .* starts at step 3, not after stage 1's 3"),
        ([(0, 4), (5, 8), (2, 2)], "starts must rise strictly"),
        ([(0, 0)], "size must be at least 1"),
        ([(0, 2.5)], "size must be a whole number"),
        ([(0, True)], "size must be a whole number"),
    ],
)
def test_bad_schedules_are_refused_with_the_stage_named(stages, message):
    with pytest.raises(ValueError, match=message):
        BatchSchedule(stages)


class Rows:
    """A finished in-memory source: row i holds `base + i` in each of its 2 columns."""

    def __init__(self, base, size):
        self.seq_len, self.rows = 2, np.repeat(np.arange(base, base + size, dtype=np.int32)[:, None], 2, axis=1)

    def get_batch(self, indices, timeout=None):
        indices = np.asarray(indices, dtype=np.int64)
        if len(indices) and indices.max() >= len(self.rows):
            raise IndexError("past the end")
        return self.rows[indices]

    def wait_for_examples(self, count, timeout=None):
        if count > len(self.rows):
            raise IndexError("past the end")

    def final_num_examples(self):
        return len(self.rows)


def test_a_mixture_under_a_schedule_reads_the_fixed_size_stream_cut_at_the_schedules_offsets():
    sources = {"a": Rows(0, 500), "b": Rows(1000, 500)}
    weights = {"a": 1, "b": 2}
    fixed = mixture_examples(sources, weights, batch_size=2, block_size=16, seed=3)
    stream = np.concatenate([fixed.batch(s)[:, 0] for s in range(60)])  # positions 0-119 at two a step
    scheduled = mixture_examples(sources, weights, batch_size=BatchSchedule(STAGES), block_size=16, seed=3)
    offsets = np.concatenate([[0], np.cumsum(sizes_by_step(STAGES, 14))])
    for step in range(14):
        want = stream[offsets[step] : offsets[step + 1]]
        np.testing.assert_array_equal(scheduled.batch(step)[:, 0], want)
        halves = [scheduled.batch(step, process_index=i, process_count=2)[:, 0] for i in range(2)]
        np.testing.assert_array_equal(np.concatenate(halves), want)  # each reader's slice of the same batch
        np.testing.assert_array_equal(scheduled.step_rows(step, 1, 2)[:, 0], want[1:2])
    assert scheduled.examples_seen(9) == fixed.layout.examples_seen(int(offsets[9]) // 2)


def test_weight_stages_start_at_their_step_under_a_schedule():
    schedule = parse_train_weights([[0, {"a": 1, "b": 0}], [4, {"a": 0, "b": 1}]], ["a", "b"])
    layout = MixtureLayout(schedule, batch_size=BatchSchedule(STAGES), block_size=16, seed=0)
    before = layout.locate(np.arange(layout.batches.offset(4)))[0]
    after = layout.locate(layout.batches.positions(4))[0]
    assert set(before.tolist()) == {0} and set(after.tolist()) == {1}  # step 4's first example is b's


def test_first_exhausted_names_the_step_of_the_schedule():
    sources = {"a": Rows(0, 30)}  # positions 0-29: steps 0-2 (12), 3-4 (16), 5 (2): step 6 needs 30-31
    mix = mixture_examples(
        sources, {"a": 1}, batch_size=BatchSchedule(STAGES), block_size=16, stop_strategy="first_exhausted"
    )
    mix.batch(5)
    with pytest.raises(MixtureExhaustedError) as error:
        mix.batch(6)
    assert error.value.step == 6 and mix.exhaustion_step() == 6
