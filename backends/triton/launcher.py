"""`Launcher`: how every kernel of the Triton backends is launched, written once.

The first launch of each compiled variant goes through Triton's JIT (`kernel[grid](...)`, which compiles). After
it, on a GPU and outside any CUDA graph capture, a fast launcher is bound to the compiled kernel and validated by
one no-op launch that must store its token into a pinned word. On NVIDIA, where the compiled staging helper is
built: the CUDA driver's cuLaunchKernelEx called from C (`_cstaging.DriverLaunch`, its parameters checked against
the driver's account of the kernel's), with Triton's compiled C launcher behind it for what it does not take. Else
that C launcher called directly (the calling conventions of Triton 3.6 and 3.9; through `_cstaging.FastLaunch`),
else `CompiledKernel.run`. Each skips the JIT's argument binding and specialization, the larger part of a launch's
host time. Under Triton's interpreter every launch is the
JIT's, serialized process-wide (the interpreter keeps program ids in global state).
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import triton

from multiwrite.capture import is_capturing, setup_calls, simulated_graph
from multiwrite.staging.fields import _cstaging

if TYPE_CHECKING:
    from multiwrite.backends.triton.device import TritonDevice

#: Triton's interpreter keeps the current program ids in module-level state: one interpreted launch at a time.
INTERPRETER_LOCK = threading.Lock()
#: The current device and raw stream of torch, as the C functions themselves (absent from CPU-only builds, where
#: only the interpreter runs).
get_device: Callable[[], int] = getattr(torch._C, "_cuda_getDevice", lambda: 0)
get_stream: Callable[[int], int] = getattr(torch._C, "_cuda_getCurrentRawStream", lambda index: 0)
#: Seconds a validation launch may take to store its token.
VALIDATION_TIMEOUT_S = 10.0


class Launcher:
    """Launches one kernel on one device (module docstring).

    Args:
        device: the `TritonDevice`.
        kernel: the `@triton.jit` kernel (an interpreted function under `TRITON_INTERPRET=1`).
        num_warps: warps per program.
        noop_args: `noop_args(done_addr, counter_addr, token)` -> the arguments of a launch of one program that
            writes nothing and stores `token` into `done_addr` (the validation of a fast launcher).

    Attributes:
        launches: launches issued so far (a statistic: increments from concurrent threads may be lost).
        path: how launches go: "interpreter", "jit" (before the first launch), or per compiled variant the bound
            launcher ("driver (triton X)", "c-launcher (triton X)", "compiled-kernel-run (triton X)") or why none
            ("jit (...)").
    """

    def __init__(self, device: TritonDevice, kernel: Any, num_warps: int, noop_args: Callable[[int, int, int], tuple]):
        self.device = device
        self.kernel = kernel
        self.num_warps = num_warps
        self.noop_args = noop_args
        self.fire: dict[tuple, Callable | None] = {}  # variant -> fire(grid0, grid1, stream, args), None: JIT only
        self.path = "interpreter" if not device.is_gpu else "jit"
        self.launches = 0  # launches issued (or recorded by a simulated capture)
        self._lock = threading.Lock()

    def launch(self, variant: tuple, consts: dict, grid0: int, grid1: int, args: tuple, jit: bool = False,
               **options: Any) -> None:  # fmt: skip
        """Launch `grid0 x grid1` programs with `args` and the compile-time constants `consts` (`variant`: a hashable
        name of them), on the current stream of the device. `jit`: through the JIT (a launch being captured into a
        CUDA graph, or one with launch `options` such as `launch_pdl`)."""
        fire = None if jit else self.fire.get(variant)
        if fire is not None:
            index = self.device.index
            if index == get_device():
                fire(grid0, grid1, get_stream(index), args)
            else:
                with torch.cuda.device(index):
                    fire(grid0, grid1, get_stream(index), args)
            self.launches += 1
            return
        device = self.device
        if not device.is_gpu:
            graph = simulated_graph()
            run = functools.partial(self._interpret, grid0, grid1, args, consts)
            run() if graph is None else graph.record(run)
            self.launches += 1
            return
        capturing = is_capturing(device.device)
        with self._lock, torch.cuda.device(device.index):
            compiled = self.kernel[(grid0, grid1)](*args, **consts, num_warps=self.num_warps, num_stages=1, **options)
            self.launches += 1
            if jit or options or variant in self.fire or device.launcher == "jit" or capturing:
                return  # (bound at a later plain launch: binding validates with a launch of its own)
            self.fire[variant], self.path = bind_fast_launcher(compiled, tuple(consts.values()), device.device,
                                                               device.launcher, self._validate)  # fmt: skip

    def _interpret(self, grid0: int, grid1: int, args: tuple, consts: dict) -> None:
        with INTERPRETER_LOCK:
            self.kernel[(grid0, grid1)](*args, **consts, num_warps=self.num_warps, num_stages=1)

    def _validate(self, fire: Callable) -> None:
        """One no-op launch through `fire` on a stream of its own (the caller's may be busy): it must store its token
        into the device's validation word within `VALIDATION_TIMEOUT_S` (polled: no synchronization)."""
        device = self.device
        word = device.validation_word
        # (a token of its own, never the word's next value: an interrupted validation's launch may store its
        # token late, and must not pass a later one)
        token = device.validation_token = device.validation_token % 0x7FFFFFFF + 1
        with torch.cuda.device(device.index), setup_calls(device.device):
            stream = torch.cuda.Stream(device.device)
            fire(1, 1, stream.cuda_stream, self.noop_args(device.validation_addr, device.validation_counter, token))
        deadline = time.perf_counter() + VALIDATION_TIMEOUT_S
        while int(word[0]) != token:
            if time.perf_counter() > deadline:
                raise RuntimeError(f"validation launch did not complete (its word holds {int(word[0])}, not {token})")
            time.sleep(1e-5)


def c_launcher(launch: Callable, head: tuple, consts: tuple, packed: bool) -> Callable:
    """`fire(grid0, grid1, stream, args)` calling Triton's compiled C launcher `launch` as `launch(grid0, grid1, 1,
    stream, *head, *args, *consts)`, or with `packed` (Triton 3.9) `launch(grid0, grid1, 1, stream, *head, (*args,
    *consts))`: the compiled `_cstaging.FastLaunch` (one C call, no Python frame) where that helper is built, else
    its Python twin."""
    if _cstaging is not None:
        return _cstaging.FastLaunch(launch, head, consts, packed)
    if packed:

        def fire(g0, g1, stream, args):
            launch(g0, g1, 1, stream, *head, (*args, *consts))

    else:

        def fire(g0, g1, stream, args):
            launch(g0, g1, 1, stream, *head, *args, *consts)

    return fire


def bind_fast_launcher(
    kernel: Any, consts: tuple, device: torch.device, mode: str, validate: Callable[[Callable], None]
) -> tuple[Callable | None, str]:
    """A launch function `fire(grid0, grid1, stream, args)` for a compiled `kernel` that bypasses the JIT, and the
    launch path it gives; `(None, why)` when none works.

    Candidates, fastest first (only with `mode == "auto"` on NVIDIA, for a kernel without scratch memory: the first
    two): the CUDA driver's cuLaunchKernelEx called from C (`driver_launcher`), Triton's compiled C launcher called
    directly (Triton 3.6 and 3.9 calling conventions), then `CompiledKernel.run`. `validate(fire)` must pass before a
    candidate is used.
    """
    reasons = []
    try:
        from triton import knobs

        hook = getattr(knobs.runtime, "launch_enter_hook", None)
        if hook is not None and getattr(hook, "calls", True):
            raise RuntimeError("Triton launch hooks are installed (profiling): keep the JIT path")
        run, function, packed = kernel.run, kernel.function, kernel.packed_metadata
    except Exception as exc:
        return None, f"jit (no fast launcher: {type(exc).__name__}: {exc})"
    candidates = []
    launch = getattr(run, "launch", None)
    if mode == "auto" and device.type == "cuda" and torch.version.hip is None and launch is not None:
        scratch = (getattr(run, "global_scratch_size", 1), getattr(run, "profile_scratch_size", 1))
        coop, pdl = getattr(run, "launch_cooperative_grid", None), getattr(run, "launch_pdl", None)
        if scratch == (0, 0) and coop is not None and pdl is not None and not getattr(run, "gsan_enabled", False):
            if hasattr(run, "arg_annotations"):  # Triton 3.9: (..., hooks, scratch, annotations, sig, args)
                head = (function, coop, pdl, packed, None, None, None, None, None, run.arg_annotations,
                        run.kernel_signature)  # fmt: skip
                fire = c_launcher(launch, head, consts, True)
            else:  # Triton 3.6: (..., scratch, scratch, metadata, launch metadata, hooks, *args)
                fire = c_launcher(launch, (function, coop, pdl, None, None, packed, None, None, None), consts, False)
            try:
                candidates.append(("driver", driver_launcher(kernel, len(consts), fire)))
            except Exception as exc:
                reasons.append(f"driver: {type(exc).__name__}: {exc}")
            candidates.append(("c-launcher", fire))
        else:
            reasons.append(f"c-launcher: scratch={scratch} cooperative={coop} pdl={pdl}")

    def fire_run(g0, g1, stream, args):
        run(g0, g1, 1, stream, function, packed, None, None, None, *args, *consts)

    candidates.append(("compiled-kernel-run", fire_run))
    for name, fire in candidates:
        try:
            validate(fire)
        except Exception as exc:
            reasons.append(f"{name}: {type(exc).__name__}: {exc}")
            continue
        path = f"{name} (triton {triton.__version__})"
        return fire, path + (f"; not used: {'; '.join(reasons)}" if reasons else "")
    return None, f"jit (no fast launcher: {'; '.join(reasons)})"


#: Bytes of a kernel argument of each Triton type as cuLaunchKernelEx takes it (0: a compile-time constant, not
#: passed; pointers: 8). Any other type keeps Triton's launcher.
PARAM_BYTES = {"constexpr": 0, "i32": 4, "i64": 8}


def driver_param_kinds(kernel: Any, num_consts: int) -> bytes:
    """Per entry of a launch's `args` (the compiled `kernel`'s signature less its last `num_consts` constexprs) the
    bytes it takes in the kernel's parameters (`PARAM_BYTES`).

    Raises:
        ValueError: a trailing constant that is not a constexpr, or an argument of a type not in `PARAM_BYTES`.
    """
    items = list(kernel.src.signature.items())
    cut = len(items) - num_consts
    if cut < 0 or any(t != "constexpr" for _, t in items[cut:]):
        raise ValueError(f"the last {num_consts} arguments of {[t for _, t in items]} are not all constexprs")
    kinds = []
    for name, t in items[:cut]:
        if t.startswith("*"):
            kinds.append(8)
        elif t in PARAM_BYTES:
            kinds.append(PARAM_BYTES[t])
        else:
            raise ValueError(f"argument {name} is of type {t}: not passed by multiwrite's driver launch")
    return bytes(kinds)


@functools.cache
def cuda_driver() -> tuple[int, Callable[[int], list[int]]]:
    """The address of the CUDA driver's cuLaunchKernelEx and `param_sizes(function)`, the bytes of each parameter of
    a CUfunction (cuFuncGetParamInfo, CUDA 12.4 and newer).

    Raises:
        OSError: no libcuda.so.1; AttributeError: a driver without those entry points; from `param_sizes`,
        RuntimeError: an error of cuFuncGetParamInfo other than "past the last parameter".
    """
    import ctypes

    lib = ctypes.CDLL("libcuda.so.1")
    launch_ex = ctypes.cast(lib.cuLaunchKernelEx, ctypes.c_void_p).value
    info = lib.cuFuncGetParamInfo
    size_t = ctypes.c_size_t
    info.restype = ctypes.c_int
    info.argtypes = [ctypes.c_void_p, size_t, ctypes.POINTER(size_t), ctypes.POINTER(size_t)]

    def param_sizes(function: int) -> list[int]:
        sizes, offset, size = [], size_t(), size_t()
        while len(sizes) < 1024:
            result = info(function, len(sizes), ctypes.byref(offset), ctypes.byref(size))
            if result == 1:  # CUDA_ERROR_INVALID_VALUE: past the last parameter
                return sizes
            if result != 0:
                raise RuntimeError(f"cuFuncGetParamInfo({len(sizes)}): CUDA error {result}")
            sizes.append(size.value)
        raise RuntimeError("cuFuncGetParamInfo: more than 1024 parameters")

    return launch_ex, param_sizes


def driver_launcher(kernel: Any, num_consts: int, fallback: Callable) -> Callable:
    """`fire(grid0, grid1, stream, args)` as one cuLaunchKernelEx of the compiled `kernel` from C
    (`_cstaging.DriverLaunch`), what it does not take going to `fallback` (Triton's launcher). Its parameters are
    checked against the driver's own account of the kernel's (cuFuncGetParamInfo): the passed arguments in order,
    then at most two 8-byte scratch pointers, which it passes as 0.

    Raises:
        ValueError, OSError, AttributeError: no such launch for this kernel, driver or build (the reason).
    """
    if _cstaging is None:
        raise ValueError("the compiled staging helper is not built")
    kinds = driver_param_kinds(kernel, num_consts)
    md = kernel.metadata
    ctas, coop, shared = (getattr(md, f, None) for f in ("num_ctas", "launch_cooperative_grid", "shared"))
    if ctas != 1 or coop is not False or not isinstance(shared, int) or shared > 228 * 1024:
        raise ValueError(f"num_ctas={ctas} cooperative={coop} shared={shared}")
    launch_ex, param_sizes = cuda_driver()
    sizes, passed = param_sizes(kernel.function), [k for k in kinds if k]
    extra = len(sizes) - len(passed)
    if sizes[: len(passed)] != passed or not 0 <= extra <= 2 or any(s != 8 for s in sizes[len(passed) :]):
        raise ValueError(f"the kernel's parameters (bytes {sizes}) are not its arguments {passed} and scratch pointers")
    return _cstaging.DriverLaunch(launch_ex, kernel.function, 32 * md.num_warps, md.shared, bool(md.launch_pdl),
                                  kinds, extra, fallback)  # fmt: skip
