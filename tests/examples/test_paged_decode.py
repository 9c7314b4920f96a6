"""`examples/paged_decode.py` at its tiny size on CPU: the verdict is OK with FlexAttention and with the fallback, and
the check fails when one slot or one gathered block id is wrong."""

from __future__ import annotations

import dataclasses
import sys

import pytest
import torch

from multiwrite.bench.paged_attention import PagedAttention
from multiwrite.plugins.dispatch import BACKEND_ENV
from multiwrite.workload import load_trace
from tests.support.example_scripts import load_example


@pytest.fixture(scope="module")
def example():
    yield load_example("paged_decode", "paged_decode")
    del sys.modules["paged_decode"]


@pytest.fixture(autouse=True)
def _cpu_backend(monkeypatch):
    """CPU tables: a GPU backend forced by tox -e cuda cannot run them."""
    monkeypatch.delenv(BACKEND_ENV, raising=False)


def _run(example, impl: str, tamper=None, steps: int = 8):
    size = dataclasses.replace(example.SIZES["tiny"], steps=steps)
    with torch.no_grad():
        return example.run(size, torch.device("cpu"), PagedAttention(impl), load_trace(), tamper)


@pytest.mark.parametrize("impl", ["flex-paged", "sdpa-gathered"])
def test_the_tiny_loop_admits_finishes_and_matches_dense_attention(example, impl):
    r = _run(example, impl, steps=12)
    assert r.steps == 12 and r.admitted == 8 and r.finished == 4  # the trace's short requests finish in 12 steps
    assert r.checked == 355  # every token of every step: prefill chunks and decodes
    assert r.worst < 1e-5 and r.misplaced == 0  # float32 against float64: rounding only


def test_main_prints_the_attention_that_ran_and_the_verdict(example, capsys):
    assert example.main(["--size", "tiny", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "attention: flex-paged (eager)" in out and "verdict: OK" in out and "355 token outputs checked" in out
    assert "not at the slot their request's block ids give: 0" in out


@pytest.mark.parametrize("impl", ["flex-paged", "sdpa-gathered"])
def test_one_wrong_slot_fails_the_check(example, impl):
    planted = []

    def wrong_slot(step, gathered, slots):
        if step == 3 and not planted:  # token 1 written over token 0's slot: one of the two reads stale K/V
            assert slots.numel() >= 2
            slots[1] = slots[0]
            planted.append(step)

    r = _run(example, impl, wrong_slot)
    # index_copy_ on a CPU copies in order: token 0's slot ends up holding token 1's K/V, token 1's slot stale values
    assert planted == [3] and r.misplaced == 2 and r.worst > 100 * example.SIZES["tiny"].tolerance


@pytest.mark.parametrize("impl", ["flex-paged", "sdpa-gathered"])
def test_one_wrong_block_id_fails_the_check(example, impl):
    planted = []

    def wrong_block(step, gathered, slots):
        if step == 5 and not planted:  # the first entry's first block: attention reads another page
            assert int(gathered[0, 0]) > 0
            gathered[0, 0] += 1
            planted.append(step)

    r = _run(example, impl, wrong_block)
    assert planted == [5] and r.misplaced == 0 and r.worst > 100 * example.SIZES["tiny"].tolerance
