import numpy as np
import pyarrow as pa
import pytest

from shard_cache.chunk_reading import arrow_to_numpy


@pytest.mark.parametrize(
    "array",
    [
        pa.array([1, -2, 3], pa.int32()),
        pa.array([0, 2**32 - 1, 7], pa.uint32()),
        pa.array([2**40, -1], pa.int64()),
        pa.array([0, 1, 2, 3, 4, 5, 6], pa.int16()).slice(2, 4),  # an offset into the buffer
        pa.array([1.5, -0.25], pa.float32()),
        pa.array([1, None, 3], pa.int32()),  # nulls: pyarrow's own conversion
        pa.array([True, False, True]),  # bits, unpacked
        pa.array([True, False, True, True, False, False, True, False, True, True, False]).slice(3, 7),
        pa.array([True, None, False]),  # nulls: pyarrow's own conversion
        pa.ListArray.from_arrays(pa.array([0, 2, 5], pa.int32()), pa.array(range(5), pa.int32())).slice(1).offsets,
    ],
)
def test_the_same_values_and_dtype_as_pyarrows_to_numpy(array):
    ours, theirs = arrow_to_numpy(array), array.to_numpy(zero_copy_only=False)
    assert ours.dtype == theirs.dtype
    np.testing.assert_array_equal(ours, theirs)
