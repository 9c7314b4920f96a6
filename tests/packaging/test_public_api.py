"""The public names of `multiwrite`: every error and warning the README documents is importable from `multiwrite` and
`multiwrite.errors` as one class, with the base class a caller catches it by."""

from __future__ import annotations

import pytest

import multiwrite
import multiwrite.errors

#: name -> the built-in base class it is caught by
ERRORS = {
    "StagedWriteError": ValueError,
    "StageInputError": ValueError,
    "TableMovedError": ValueError,
    "BlockTableWriteError": RuntimeError,
    "BackendUnavailableError": RuntimeError,
    "BackendError": RuntimeError,
    "GraphCaptureError": RuntimeError,
    "GraphProtocolError": RuntimeError,
    "ForkedCudaError": RuntimeError,
    "RingStallError": RuntimeError,
    "RingWaitWarning": RuntimeWarning,
}


@pytest.mark.parametrize(("name", "base"), ERRORS.items(), ids=list(ERRORS))
def test_every_documented_error_is_public_and_caught_by_its_base_class(name, base):
    cls = getattr(multiwrite, name)
    assert name in multiwrite.__all__ and cls is getattr(multiwrite.errors, name)
    assert issubclass(cls, base) and cls.__module__ == "multiwrite.errors" and cls.__doc__


def test_every_exception_class_of_the_errors_module_is_public():
    defined = {n for n, v in vars(multiwrite.errors).items() if isinstance(v, type) and issubclass(v, BaseException)}
    assert defined == set(ERRORS)
