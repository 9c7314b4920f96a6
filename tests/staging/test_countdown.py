"""`Countdown` (the periodic address check of a `BlockTables`' preamble): the compiled type and its Python twin give
the same truth tests: false `period - 1` times, then true, and true at every test after it until `restart()`."""

from __future__ import annotations

import pytest

from multiwrite.staging import fields

KINDS = [
    pytest.param(fields.PyCountdown, id="python"),
    pytest.param(getattr(fields._cstaging, "Countdown", None), id="c",
                 marks=pytest.mark.skipif(not fields.COMPILED, reason="multiwrite.staging._cstaging is not built")),
]  # fmt: skip


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("period", [1, 2, 5, 64])
def test_true_at_every_period_th_test_and_until_restarted(kind, period):
    c = kind(period)
    assert (c.period, c.left) == (period, period)
    assert [bool(c) for _ in range(period + 3)] == [False] * (period - 1) + [True] * 4
    assert c.left == 0
    c.restart()
    assert c.left == period
    assert [bool(c) for _ in range(period + 1)] == [False] * (period - 1) + [True, True]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("period", [0, -3])
def test_a_period_below_one_is_refused(kind, period):
    with pytest.raises(ValueError, match=rf"^Countdown: period must be >= 1, got {period}$"):
        kind(period)


def test_the_compiled_type_is_the_one_used_where_built():
    assert fields.Countdown is (fields._cstaging.Countdown if fields.COMPILED else fields.PyCountdown)
