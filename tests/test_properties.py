"""Property tests against the sequential reference, per built-in backend and staging path: the
conformance kit's hypothesis tests (`multiwrite.testing.properties`), collected here."""

from multiwrite.testing.properties import *  # noqa: F403
