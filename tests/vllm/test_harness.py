"""The oracle harness itself (tests/vllm/oracle.py), without vLLM: locating the two files, loading them with the
stand-ins and leaving `sys.modules` as it was, and the bool-mask workaround for Triton's interpreter."""

from __future__ import annotations

import os
import sys
import textwrap
import zipfile

import pytest
import torch

from tests.vllm import oracle

FAKE_BUFFER_UTILS = """
from vllm.logger import init_logger
from vllm.triton_utils import tl, triton
from vllm.utils.platform_utils import is_uva_available
from vllm.utils.torch_utils import async_tensor_h2d, get_accelerator_view_from_cpu_tensor

logger = init_logger(__name__)

def device_type():
    from vllm.platforms import current_platform  # imported when called, as vLLM's buffers do
    return current_platform.device_type
"""
FAKE_BLOCK_TABLE = """
from vllm.v1.attention.backends.utils import PAD_SLOT_ID
from vllm.v1.worker.gpu.buffer_utils import device_type, is_uva_available

class BlockTables:
    def __init__(self):
        self.pad, self.uva, self.device = PAD_SLOT_ID, is_uva_available(), device_type()
"""


@pytest.fixture
def fake_sources(tmp_path):
    (tmp_path / "buffer_utils.py").write_text(FAKE_BUFFER_UTILS)
    (tmp_path / "block_table.py").write_text(FAKE_BLOCK_TABLE)
    return tmp_path


@pytest.fixture
def no_env(monkeypatch):
    monkeypatch.delenv(oracle.SRC_ENV, raising=False)
    monkeypatch.delenv(oracle.WHEEL_ENV, raising=False)


def test_unconfigured_says_how_to_run(no_env, tmp_path):
    assert not oracle.configured()
    with pytest.raises(oracle.OracleConfigError, match=r"tox -e vllm"):
        oracle.locate_sources(tmp_path)


def test_source_directory(no_env, monkeypatch, fake_sources, tmp_path):
    monkeypatch.setenv(oracle.SRC_ENV, str(fake_sources))
    assert oracle.locate_sources(tmp_path / "unused") == fake_sources
    (fake_sources / "buffer_utils.py").unlink()
    with pytest.raises(oracle.OracleConfigError, match=rf"{oracle.SRC_ENV}=.*no buffer_utils\.py"):
        oracle.locate_sources(tmp_path / "unused")


def test_wheel_extraction(no_env, monkeypatch, fake_sources, tmp_path):
    wheel = tmp_path / "vllm-0.33.0-fake.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        for name, member in oracle.MEMBERS.items():
            z.writestr(member, (fake_sources / name).read_text())
        z.writestr("vllm/other.py", "")
    monkeypatch.setenv(oracle.WHEEL_ENV, str(wheel))
    out = oracle.locate_sources(tmp_path / "x")
    assert sorted(p.name for p in out.iterdir()) == ["block_table.py", "buffer_utils.py"]
    assert (out / "block_table.py").read_text() == FAKE_BLOCK_TABLE
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr(oracle.MEMBERS["block_table.py"], "")
    with pytest.raises(oracle.OracleConfigError, match=r"holds no vllm/v1/worker/gpu/buffer_utils\.py"):
        oracle.locate_sources(tmp_path / "y")
    wheel.write_text("not a zip")
    with pytest.raises(oracle.OracleConfigError, match=r"not a wheel"):
        oracle.locate_sources(tmp_path / "z")
    monkeypatch.setenv(oracle.WHEEL_ENV, str(tmp_path / "missing.whl"))
    with pytest.raises(oracle.OracleConfigError, match=r"missing\.whl: no such file"):
        oracle.locate_sources(tmp_path / "w")


def test_loading_leaves_sys_modules_as_it_was(fake_sources, monkeypatch):
    sentinel = type(sys)("vllm.logger")
    monkeypatch.setitem(sys.modules, "vllm.logger", sentinel)  # something already there is restored, not dropped
    before = {k for k in sys.modules if k.split(".")[0] == "vllm"}
    loaded = oracle.load_oracle(fake_sources, "cpu")
    assert {k for k in sys.modules if k.split(".")[0] == "vllm"} == before
    assert sys.modules["vllm.logger"] is sentinel
    made = loaded.make()  # the lazy `vllm.platforms` import finds its stand-in while vLLM's code runs
    assert (made.pad, made.uva, made.device) == (-1, False, "cpu")
    assert sys.modules["vllm.logger"] is sentinel and "vllm.platforms" not in sys.modules


@pytest.mark.skipif(torch.cuda.is_available(), reason="Triton's interpreter runs only without a GPU here")
def test_bool_masks_for_the_interpreter():
    """A mask from a value loaded through a bool pointer, or'ed with a block comparison (vLLM's DCP test): exact
    with the workaround, and the builder's methods are restored after it."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    import triton
    import triton.language as tl
    from triton.runtime import interpreter

    @triton.jit
    def kernel(flag_ptr, x_ptr, out_ptr, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        flag = tl.load(flag_ptr)
        mask = ~flag | (offs % 2 == 0)
        tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=mask, other=-1), mask=mask)

    x = torch.arange(8, dtype=torch.int32) + 10
    original = interpreter.InterpreterBuilder.__dict__["create_masked_load"]
    for flag, expected in ((True, [10, 0, 12, 0, 14, 0, 16, 0]), (False, list(range(10, 18)))):
        out = torch.zeros(8, dtype=torch.int32)
        with oracle.interpreter_bool_masks():
            kernel[(1,)](torch.tensor([flag]), x, out, BLOCK=8)
        assert out.tolist() == expected
    assert interpreter.InterpreterBuilder.__dict__["create_masked_load"] is original
    if triton.__version__.startswith("3.9."):  # why the workaround exists
        with pytest.raises(Exception, match="mask has unsupported dtype"):
            kernel[(1,)](torch.tensor([True]), x, torch.zeros(8, dtype=torch.int32), BLOCK=8)


def test_fetch_keeps_a_wheel_already_there(tmp_path):
    wheel = tmp_path / "vllm-0.33.0.whl"
    wheel.write_bytes(b"cached")
    assert oracle.fetch_wheel(wheel) == wheel and wheel.read_bytes() == b"cached"  # no download


def test_stand_in_logger_warns_once(caplog):
    log = oracle._OnceLogger(oracle.logging.getLogger("tests.vllm.once"), {})
    with caplog.at_level("WARNING", logger="tests.vllm.once"):
        for _ in range(3):
            log.warning_once("falling back %s", textwrap.dedent("x"))
    assert [r.getMessage() for r in caplog.records] == ["falling back x"]


def test_extract_for_a_machine_without_network(no_env, fake_sources, tmp_path):
    wheel = tmp_path / "w.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        for name, member in oracle.MEMBERS.items():
            z.writestr(member, (fake_sources / name).read_text())
    out = oracle.extract(wheel, tmp_path / "ship")
    assert (out / "buffer_utils.py").read_text() == FAKE_BUFFER_UTILS
    assert not oracle.configured()  # the environment is left as it was
