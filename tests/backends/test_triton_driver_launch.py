"""The driver launch (`backends/triton/launcher.py`, `driver_launcher`; `_cstaging.DriverLaunch`): what it hands the
CUDA driver's cuLaunchKernelEx, read back by a stand-in for that function (a C-callable ctypes function: no GPU
needed), what it leaves to Triton's launcher, and when `bind_fast_launcher` chooses it. The parameter layout it
derives from a compiled kernel is checked against the kernels' PTX in test_triton_compile.py."""

from __future__ import annotations

import ctypes
import types

import numpy as np
import pytest
import torch

from multiwrite.backends.triton import launcher as launcher_module
from multiwrite.backends.triton.launcher import bind_fast_launcher, driver_launcher, driver_param_kinds

_cstaging = launcher_module._cstaging
needs_helper = pytest.mark.skipif(_cstaging is None, reason="the compiled staging helper is not built")
CUDA = torch.device("cuda", 0)


class LaunchConfig(ctypes.Structure):
    """cuda.h's CUlaunchConfig."""

    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.c_void_p), ("num_attrs", ctypes.c_uint)]  # fmt: skip


class LaunchAttribute(ctypes.Structure):
    """cuda.h's CUlaunchAttribute (the value's first int: programmaticStreamSerializationAllowed)."""

    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int), ("rest", ctypes.c_char * 60)]


PROTOTYPE = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)


class FakeDriver:
    """cuLaunchKernelEx's stand-in: records each call (config, function, the parameters as `sizes` says, extra) and
    returns `result`."""

    def __init__(self, sizes: list[int], result: int = 0):
        self.sizes, self.result, self.calls = sizes, result, []
        self.fn = PROTOTYPE(self._launch)  # (kept alive as long as the driver)
        self.address = ctypes.cast(self.fn, ctypes.c_void_p).value

    def _launch(self, config, function, params, extra):
        c = LaunchConfig.from_address(config)
        attrs = [LaunchAttribute.from_address(c.attrs + i * 72) for i in range(c.num_attrs)]
        slots = (ctypes.c_void_p * len(self.sizes)).from_address(params)
        kinds = {4: ctypes.c_int32, 8: ctypes.c_int64}
        values = [kinds[s].from_address(slots[i]).value for i, s in enumerate(self.sizes)]
        self.calls.append({"grid": tuple(c.grid), "block": tuple(c.block), "shared": c.shared, "stream": c.stream,
                           "attrs": [(a.id, a.value) for a in attrs], "function": function, "params": values,
                           "extra": extra})  # fmt: skip
        return self.result


class Fallback:
    def __init__(self):
        self.calls = []

    def __call__(self, *args):
        self.calls.append(args)
        return None


@needs_helper
def test_each_parameter_reaches_the_driver_as_the_kernel_takes_it():
    """A pointer, an int32 (negative), a constexpr (skipped), an int64 past 32 bits, then two zero scratch pointers;
    the grid, 32 threads per warp, the shared memory, the stream and the PDL attribute."""
    driver = FakeDriver([8, 4, 8, 8, 8])
    fallback = Fallback()
    fire = _cstaging.DriverLaunch(driver.address, 0x1234, 128, 96, True, bytes([8, 4, 0, 8]), 2, fallback)
    assert fire(3, 2, 0x77, (0xDEAD0000, -5, "constexpr", (1 << 40) + 3)) is None
    (call,) = driver.calls
    assert call["grid"] == (3, 2, 1) and call["block"] == (128, 1, 1) and call["shared"] == 96
    assert call["stream"] == 0x77 and call["function"] == 0x1234 and call["extra"] is None
    assert call["attrs"] == [(6, 1)]  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    assert call["params"] == [0xDEAD0000, -5, (1 << 40) + 3, 0, 0]
    assert fallback.calls == []
    one = FakeDriver([4])
    plain = _cstaging.DriverLaunch(one.address, 7, 32, 0, False, bytes([4]), 0, fallback)
    plain(1, 1, 0, (2**31 - 1,))
    assert one.calls[-1]["attrs"] == [] and one.calls[-1]["params"] == [2**31 - 1]
    assert plain.fallback is fallback


@needs_helper
def test_what_the_driver_launch_does_not_take_goes_to_triton_unchanged():
    driver = FakeDriver([4, 8])
    fallback = Fallback()
    fire = _cstaging.DriverLaunch(driver.address, 1, 128, 0, False, bytes([4, 8]), 0, fallback)
    for args in ((2**31, 5), (-(2**31) - 1, 5), (1, 1 << 64), (1.0, 5), (True, 5), (torch.tensor(1), 5)):
        fire(1, 1, 0, args)
        assert fallback.calls[-1] == (1, 1, 0, args)
    fire(2**31, 1, 0, (1, 2))  # a grid past the driver's x limit
    fire(1, 65536, 0, (1, 2))  # and y limit
    assert len(fallback.calls) == 8 and driver.calls == []
    fire(0, 1, 0, (1, 2))  # an empty grid launches nothing, as Triton's launcher
    fire(4, 0, 0, (1, 2))
    assert driver.calls == [] and len(fallback.calls) == 8
    refused = FakeDriver([4, 8], result=201)  # CUDA_ERROR_INVALID_CONTEXT: no context on this thread
    fire = _cstaging.DriverLaunch(refused.address, 1, 128, 0, False, bytes([4, 8]), 0, fallback)
    fire(1, 1, 9, (3, 4))
    assert len(refused.calls) == 1 and fallback.calls[-1] == (1, 1, 9, (3, 4))

    def failing(*args):
        raise RuntimeError("Triton Error [CUDA]: invalid argument")

    fire = _cstaging.DriverLaunch(refused.address, 1, 128, 0, False, bytes([4, 8]), 0, failing)
    with pytest.raises(RuntimeError, match="invalid argument"):
        fire(1, 1, 9, (3, 4))


@needs_helper
def test_the_driver_launch_refuses_calls_and_layouts_it_cannot_serve():
    driver = FakeDriver([4])
    fire = _cstaging.DriverLaunch(driver.address, 1, 32, 0, False, bytes([4]), 0, Fallback())
    with pytest.raises(TypeError, match="four positional arguments"):
        fire(1, 1, 0)
    with pytest.raises(TypeError, match="args a tuple"):
        fire(1, 1, 0, [5])
    with pytest.raises(TypeError, match="2 kernel arguments, the kernel takes 1"):
        fire(1, 1, 0, (5, 6))
    with pytest.raises(TypeError, match="not initialized"):
        type(fire).__new__(type(fire))(1, 1, 0, ())
    with pytest.raises(ValueError, match=r"kinds\[1\] is 2"):
        _cstaging.DriverLaunch(driver.address, 1, 32, 0, False, bytes([4, 2]), 0, Fallback())
    with pytest.raises(ValueError, match="at most 64"):
        _cstaging.DriverLaunch(driver.address, 1, 32, 0, False, bytes([8] * 63), 2, Fallback())
    with pytest.raises(ValueError, match="fallback callable"):
        _cstaging.DriverLaunch(driver.address, 1, 32, 0, False, b"", 0, None)
    assert driver.calls == []


def _compiled(signature: dict, **metadata) -> types.SimpleNamespace:
    md = {"num_warps": 4, "num_ctas": 1, "shared": 0, "launch_pdl": False, "launch_cooperative_grid": False}
    return types.SimpleNamespace(src=types.SimpleNamespace(signature=signature), function=0x99,
                                 metadata=types.SimpleNamespace(**{**md, **metadata}))  # fmt: skip


def test_the_layout_comes_from_the_compiled_signature():
    k = _compiled({"a": "i64", "p": "*i32", "n": "i32", "skip": "constexpr", "B": "constexpr"})
    assert driver_param_kinds(k, 1) == bytes([8, 8, 4, 0])
    with pytest.raises(ValueError, match="are not all constexprs"):
        driver_param_kinds(k, 3)
    with pytest.raises(ValueError, match="argument x is of type fp32"):
        driver_param_kinds(_compiled({"x": "fp32"}), 0)
    with pytest.raises(ValueError, match="argument u is of type u64"):
        driver_param_kinds(_compiled({"u": "u64"}), 0)


@needs_helper
@pytest.mark.parametrize("sizes, taken", [([8, 4, 8, 8], True), ([8, 4], True), ([8, 4, 8], True),
                                          ([8, 8, 8, 8], False), ([8], False), ([8, 4, 8, 8, 8], False),
                                          ([8, 4, 4], False)])  # fmt: skip
def test_the_driver_launch_is_bound_first_only_where_the_driver_agrees_on_the_parameters(sizes, taken, monkeypatch):
    driver = FakeDriver(sizes)
    monkeypatch.setattr(launcher_module, "cuda_driver", lambda: (driver.address, lambda function: list(sizes)))
    k = _compiled({"a": "i64", "n": "i32", "C": "constexpr"})
    k.run = types.SimpleNamespace(launch=lambda *a: None, global_scratch_size=0, profile_scratch_size=0,
                                  launch_cooperative_grid=False, launch_pdl=False)  # fmt: skip
    k.packed_metadata = None
    fire, path = bind_fast_launcher(k, ("C",), CUDA, "auto", lambda f: None)
    assert path.startswith("driver" if taken else "c-launcher"), path
    assert (type(fire).__name__ == "DriverLaunch") is taken
    if taken:
        fire(2, 1, 5, (11, 12))
        assert driver.calls[-1]["params"][:2] == [11, 12] and driver.calls[-1]["block"] == (128, 1, 1)
    else:
        assert "driver: ValueError: the kernel's parameters" in path


@needs_helper
def test_no_driver_launch_for_clusters_cooperative_grids_or_large_shared_memory(monkeypatch):
    monkeypatch.setattr(launcher_module, "cuda_driver", lambda: (1, lambda function: [8]))
    for md in ({"num_ctas": 2}, {"launch_cooperative_grid": True}, {"shared": 229 * 1024}):
        with pytest.raises(ValueError, match="num_ctas=.* cooperative=.* shared="):
            driver_launcher(_compiled({"a": "i64"}, **md), 0, Fallback())


def _kinds(fn) -> bytes:
    """The driver kinds of a kernel's runtime parameters, from its annotations (its constexprs go as constants)."""
    from multiwrite.backends.triton.kernels.common import compilable

    params = compilable(fn, ()).params
    return bytes(launcher_module.PARAM_BYTES[p.annotation] for p in params if not p.is_constexpr)


@needs_helper
def test_the_stage_entry_hands_the_driver_the_arguments_triton_would_get(monkeypatch):
    """The compiled stage entry (`_cstaging.StageEntry`) passes a DriverLaunch its launch's ints without Python
    objects: the parameters the driver gets are the arguments Triton's launcher gets for the same launch (here the
    driver refuses each launch, so that the stand-in launcher, the fallback, which records and runs it through the
    interpreter, follows without the driver asked twice), for prepare_inputs with staged writes, gathers, slot
    mappings and apply_staged_writes."""
    from multiwrite.backends.triton.kernels import apply, stage
    from tests.support.stage_entry import GROUPS, engine_steps, entry_tables, stage_rows

    bt, stand_in = entry_tables(monkeypatch, **GROUPS)
    kinds = {"stage": _kinds(stage.stage_kernel_fn), "apply": _kinds(apply.apply_kernel_fn)}
    drivers = {name: FakeDriver(list(k), result=201) for name, k in kinds.items()}
    for name, launcher in (("stage", stand_in), ("apply", stand_in.apply)):
        for key, fire in list(launcher.fire.items()):
            launcher.fire[key] = _cstaging.DriverLaunch(drivers[name].address, 1, 128, 0, False, kinds[name], 0, fire)
    stage_rows(bt, np.random.default_rng(1))  # (appends, then apply_staged_writes through the apply kernel)
    rng = np.random.default_rng(4)
    for i, (idx, padded, nct, qsl, pos, tokens, pad) in enumerate(engine_steps(rng, 12)):
        bt._mode._countdown.restart()
        bt.append_block_ids(int(rng.integers(0, 6)), [[int(rng.integers(1, 99))], [], [7]], True)
        if i % 3 == 0:
            bt.prepare_inputs(idx, qsl, pos, padded, tokens, pad, nct)
        else:
            bt.apply_staged_writes()
            bt.gather_block_tables(idx, padded, num_computed_tokens=nct)
            bt.compute_slot_mappings(idx, qsl, pos, tokens, pad)
    launched = {"stage": [c[1:] for c in stand_in.calls], "apply": [c[1:] for c in stand_in.apply.calls]}
    assert len(launched["stage"]) >= 20 and len(launched["apply"]) >= 5
    for name, driver in drivers.items():
        assert len(driver.calls) == len(launched[name])  # (one refused driver call per launch, then the fallback)
        for (grid0, grid1, args), call in zip(launched[name], driver.calls):
            assert call["grid"] == (grid0, grid1, 1)
            assert call["params"] == [int(np.int32(a)) if k == 4 else int(a) for a, k in zip(args, kinds[name])]


@needs_helper
def test_a_launch_the_driver_takes_is_issued_once(monkeypatch):
    """The driver accepts: each of the entry's launches is one driver call and nothing reaches Triton's launcher
    (the stand-in, which records every call it gets). No kernel runs, so no ring slot is handed back: fewer staged
    launches than the ring's eight slots."""
    from multiwrite.backends.triton.kernels import apply, stage
    from tests.support.stage_entry import GROUPS, engine_steps, entry_tables, stage_rows

    bt, stand_in = entry_tables(monkeypatch, **GROUPS)
    kinds = {"stage": _kinds(stage.stage_kernel_fn), "apply": _kinds(apply.apply_kernel_fn)}
    drivers = {name: FakeDriver(list(k)) for name, k in kinds.items()}
    for name, launcher in (("stage", stand_in), ("apply", stand_in.apply)):
        for key, fire in list(launcher.fire.items()):
            launcher.fire[key] = _cstaging.DriverLaunch(drivers[name].address, 1, 128, 0, False, kinds[name], 0, fire)
    stage_rows(bt, np.random.default_rng(1))
    for idx, padded, nct, qsl, pos, tokens, pad in engine_steps(np.random.default_rng(4), 4):
        bt._mode._countdown.restart()
        bt.append_block_ids(2, [[5], [], [7]], True)
        bt.prepare_inputs(idx, qsl, pos, padded, tokens, pad, nct)
        bt.gather_block_tables(idx, padded, num_computed_tokens=nct)
    assert stand_in.calls == [] and stand_in.apply.calls == []
    assert len(drivers["stage"].calls) == stand_in.launches == 8 and len(drivers["apply"].calls) == 1
