"""`numpy-cpu-broken`: the example `numpy-cpu` backend (package `multiwrite-numpy-plugin`) with one bug: where
writes overlap, the EARLIER one wins. It exists to show that the conformance kit and `multiwrite check-backend`
catch that bug (its own tests expect exactly the overlap properties to fail)."""

from __future__ import annotations

from multiwrite_numpy.plugin import NumpyCpuBackend

from multiwrite import Backend, hookimpl


class BrokenNumpyCpuBackend(NumpyCpuBackend):
    """`NumpyCpuBackend` applying the writes in reverse staging order."""

    NAME = "numpy-cpu-broken"

    def order(self, meta):
        """THE BUG: the writes in reverse staging order, so the earlier write wins where writes overlap."""
        return reversed(list(super().order(meta)))


_BACKEND = BrokenNumpyCpuBackend()


@hookimpl
def multiwrite_backends() -> list[Backend]:
    """This plugin's backends: module-level singletons, the same instances on every call."""
    return [_BACKEND]
