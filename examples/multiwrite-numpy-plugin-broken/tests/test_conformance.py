"""multiwrite's conformance kit, run against `numpy-cpu`: every property a backend must satisfy."""

from multiwrite.testing.properties import *  # noqa: F403
from multiwrite.testing.suite import *  # noqa: F403
