import named_tensors


def test_package_imports():
    assert named_tensors.__doc__
