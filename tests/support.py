"""Helpers shared by several rooms of the suite: `from tests.support import ...`.

Append new helpers at the end of a section (or a new section of your own); do not rewrite another room's helpers.
Nothing here reads a private attribute of a multiwrite object.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import numpy as np
import torch

from multiwrite import Backend, WriteBatch, select_backend
from multiwrite.plugins.backend import META_LENGTH, META_ROW, META_START, META_TABLE, META_VALUE_OFFSET
from multiwrite.reference import ReferenceBlockTables

# -- staging, writer, block_tables, stage ------------------------------------------------------------------------

#: The backend of tests whose property does not depend on the backend (staging, argument checks): named, so that a
#: `MULTIWRITE_BACKEND` forcing a GPU backend (tox -e cuda) does not apply to them.
CPU = "torch-cpu"


def host(t: torch.Tensor) -> np.ndarray:
    """A tensor's values on the host, as numpy."""
    return t.detach().cpu().numpy()


def examples(backend: object, native: int, interpreted: int = 4) -> int:
    """Hypothesis examples for a test on `backend` (a conftest `BackendCase`): Triton's interpreter runs a launch in
    tens of milliseconds, so it gets few."""
    return interpreted if getattr(backend, "interpreted", False) else native


@dataclass(frozen=True)
class Recorded:
    """A snapshot of one `WriteBatch` as a backend received it (its arrays are only valid during the call)."""

    num_tables: int
    dtype: torch.dtype
    meta: np.ndarray
    values: np.ndarray
    may_overlap: bool
    values_in_order: bool

    def writes(self) -> list[tuple[int, int, int, list]]:
        """`(table, row, start, values)` of every write, in the order the batch lists them."""
        out = []
        for m in self.meta:
            off, n = int(m[META_VALUE_OFFSET]), int(m[META_LENGTH])
            out.append((int(m[META_TABLE]), int(m[META_ROW]), int(m[META_START]), self.values[off : off + n].tolist()))
        return out


class RecordingBackend(Backend):
    """A backend instance (pass it as `backend=`) that snapshots every `WriteBatch` it is handed, then forwards the
    call to `inner` (a built-in backend, by name or instance). `calls[i]` is the list of batches of call `i`."""

    NAME = "recording"
    SUPPORTED_DEVICE_TYPES = frozenset({"cpu", "cuda"})

    def __init__(self, inner: str | Backend = CPU, device: str | torch.device = "cpu"):
        self.inner = inner if isinstance(inner, Backend) else select_backend(torch.device(device), inner)
        self.calls: list[list[Recorded]] = []

    def not_supported_reasons(self, device, dtypes=()):
        return self.inner.not_supported_reasons(device, dtypes)

    def staging_buffers(self, device, np_dtype):
        return self.inner.staging_buffers(device, np_dtype)

    def apply(self, batches: Sequence[WriteBatch]) -> None:
        self.calls.append(
            [
                Recorded(
                    len(b.tables), b.dtype, b.meta.copy(), b.values.copy(), bool(b.may_overlap), bool(b.values_in_order)
                )  # fmt: skip
                for b in batches
            ]
        )
        self.inner.apply(batches)

    @property
    def last(self) -> Recorded:
        """The one batch of the last call (asserts there was exactly one)."""
        (batch,) = self.calls[-1]
        return batch


class HalfFailingBackend(Backend):
    """A backend that fails half-way: while `failures` is positive, each call writes the writes of the first half of
    each batch's tables, then raises `exc` (and counts one failure down); afterwards it applies everything. A plain
    sequential host backend otherwise (CPU tables)."""

    NAME = "half-failing"
    SUPPORTED_DEVICE_TYPES = frozenset({"cpu"})

    def __init__(self, exc: BaseException | None = None, failures: int = 1):
        self.exc = exc if exc is not None else RuntimeError("lost the device half-way")
        self.failures = failures
        self.calls = 0

    def apply(self, batches: Sequence[WriteBatch]) -> None:
        self.calls += 1
        failing = self.failures > 0
        for batch in batches:
            limit = len(batch.tables) // 2 if failing else len(batch.tables)
            for m in batch.meta:
                table, row, start = int(m[META_TABLE]), int(m[META_ROW]), int(m[META_START])
                off, n = int(m[META_VALUE_OFFSET]), int(m[META_LENGTH])
                if table < limit and n:
                    batch.tables[table][row, start : start + n] = torch.from_numpy(batch.values[off : off + n].copy())
        if failing:
            self.failures -= 1
            raise self.exc


def mismatches(bt, ref: ReferenceBlockTables) -> list[str]:
    """What differs between a `BlockTables` and a `ReferenceBlockTables` right after an apply of both: every group's
    device table, host `num_blocks` and `num_blocks_device`. Empty when equal."""
    bad = []
    for g, t in enumerate(bt.block_tables):
        got, want = host(t.tensor), ref.tables[g]
        if not np.array_equal(got, want):
            cells = np.argwhere(got != want)[:5].tolist()
            bad.append(f"group {g}: cells {cells} differ (got {[int(got[r, c]) for r, c in cells]}, "
                       f"want {[int(want[r, c]) for r, c in cells]})")  # fmt: skip
    if not np.array_equal(bt.num_blocks, ref.num_blocks):
        bad.append(f"num_blocks {bt.num_blocks.tolist()} != {ref.num_blocks.tolist()}")
    if not np.array_equal(host(bt.num_blocks_device), ref.num_blocks_applied):
        bad.append(f"num_blocks_device {host(bt.num_blocks_device).tolist()} != {ref.num_blocks_applied.tolist()}")
    return bad


# -- backends, gpu: the differential fuzz and the soak -------------------------------------------------------------
_FUZZ_DTYPES = [(torch.int32, np.int32), (torch.int64, np.int64), (torch.float32, np.float32)]


class FuzzMismatch(AssertionError):
    """A table differs from the reference, or one side refused what the other accepted."""


def _fuzz_values(rng: np.random.Generator, np_dtype, n: int, k: int) -> list:
    if np_dtype is np.float32:
        return [float(x) for x in rng.normal(0, 1e6, n)]  # rounded to float32 by both sides
    hi = (2**31 - 1 if np_dtype is np.int32 else 2**63 - 1) // k - 1
    if rng.integers(0, 4) == 0:  # extremes
        return [int(x) for x in rng.choice([-hi, hi, 0, 1, -1], n)]
    return [int(x) for x in rng.integers(-min(hi, 10**6), min(hi, 10**6), n)]


def run_fuzz(backend: str, device, batches: int, seed: int, engine_args: bool = False) -> dict[str, int]:
    """Run `batches` random batches on `backend` against `multiwrite.reference`; raise `FuzzMismatch` (naming seed
    and batch) at the first difference. Returns counts of what was exercised.

    One batch = a few random operations, then an apply, then every table compared with the reference: standalone
    `StagedWriteTensor`s of int32, int64 and float32 (some with `k = 2` kernel blocks per block): writes (often on a
    row written before in the same batch, so they overlap; empty ones; some invalid, which both sides must refuse,
    staging nothing), clears, resizes (`t.tensor = new`, or `t.tensor.set_(new)` in place, which both sides must
    accept or refuse alike); applied all together or as a random subset; and one `BlockTables` of two groups: appends,
    overwrites, clears, an apply (or not, this batch). With `engine_args`, applies also take an iterator, list a
    table twice, and include a second table over the memory of the first (writes land in true staging order).
    """
    from multiwrite import BlockTables, FusedStagedWriter, StagedWriteError, StagedWriteTensor
    from multiwrite.reference import ReferenceStagedTable, apply_staged_reference

    rng = np.random.default_rng(seed)
    device = torch.device(device)
    writer = FusedStagedWriter(device, backend)
    stats = dict.fromkeys(["writes", "refused", "clears", "resizes", "set_", "partial", "appends", "bt_clears"], 0)

    def new_table(i: int):
        tdt, ndt = _FUZZ_DTYPES[int(rng.integers(0, 3))]
        k = 2 if ndt is not np.float32 and rng.random() < 0.3 else 1
        shape = (int(rng.integers(1, 6)), int(rng.integers(1, 9)) * k)
        t = StagedWriteTensor(shape, tdt, device, name=f"t{i}", kernel_blocks_per_block=k)
        return t, ReferenceStagedTable(np.zeros(shape, ndt), k, name=f"t{i}")

    pairs = [new_table(i) for i in range(4)]
    if engine_args:  # t4 is a second table over t0's memory
        t0, r0 = pairs[0]
        alias = StagedWriteTensor(t0.shape, t0.dtype, device, name="t4", kernel_blocks_per_block=r0.k)
        alias.tensor = t0.tensor
        pairs.append((alias, ReferenceStagedTable(r0.table, r0.k, name="t4")))
    bt = BlockTables([16, 32], 4, [5, 4], device, kernel_block_sizes=[16, 16], backend=backend)
    ref = ReferenceBlockTables([16, 32], 4, [5, 4], [16, 16])

    def fail(batch: int, what: str) -> None:
        raise FuzzMismatch(f"{backend} seed {seed} batch {batch}: {what}")

    def both(batch: int, lib, mirror, what: str) -> bool:
        """The library's and the reference's side of one operation: both accept or both refuse."""
        try:
            lib()
            lib_ok = True
        except StagedWriteError:
            lib_ok = False
        try:
            mirror()
            ref_ok = True
        except StagedWriteError:
            ref_ok = False
        if lib_ok != ref_ok:
            fail(batch, f"{what}: library {'accepted' if lib_ok else 'refused'}, reference did not")
        return lib_ok

    for b in range(batches):
        if engine_args and rng.random() < 0.2:  # t4 then t0 on one cell of their shared memory: t0 must win
            x, y = _fuzz_values(rng, pairs[0][1].table.dtype.type, 2, pairs[0][1].k)
            for (t, r), v in ((pairs[-1], x), (pairs[0], y)):
                both(b, lambda t=t, v=v: t.stage_write(0, 0, [v]), lambda r=r, v=v: r.stage_write(0, 0, [v]), "clash")
        for _ in range(int(rng.integers(0, 7))):
            op = rng.random()
            i = int(rng.integers(0, len(pairs)))
            t, r = pairs[i]
            rows, cols = r.table.shape
            k = r.k
            if op < 0.55:  # a write: the same row as before often; sometimes invalid
                row = int(rng.integers(0, rows)) if rng.random() < 0.9 else int(rng.choice([-1, rows]))
                n = int(rng.integers(0, cols // k + 1))
                start = int(rng.integers(0, cols - n * k + 1))
                if rng.random() < 0.1:
                    start = int(rng.integers(-1, cols + 1))
                w = (row, start, _fuzz_values(rng, r.table.dtype.type, n, k))
                ok = both(b, lambda t=t, w=w: t.stage_write(*w), lambda r=r, w=w: r.stage_write(*w), f"{t.name}{w}")
                stats["writes" if ok else "refused"] += 1
                if t.num_staged_writes != r.num_staged_writes:
                    fail(b, f"{t.name}: {t.num_staged_writes} staged writes, reference {r.num_staged_writes}")
            elif op < 0.65:
                t.clear_staged_writes()
                r.clear_staged_writes()
                stats["clears"] += 1
            elif op < 0.75 and not (engine_args and i in (0, len(pairs) - 1)):  # resize (not the aliased pair)
                shape = (int(rng.integers(1, 6)), int(rng.integers(1, 9)) * k)
                new = torch.zeros(shape, dtype=t.dtype, device=device)
                h, w_ = min(rows, shape[0]), min(cols, shape[1])
                new[:h, :w_] = t.tensor[:h, :w_]
                mirror_new = np.zeros(shape, r.table.dtype)
                mirror_new[:h, :w_] = r.table[:h, :w_]
                if rng.random() < 0.5:  # in place: the same tensor object moves to the new storage
                    try:  # (staged writes that no longer fit would make the next apply refuse them all: skip)
                        r.replace(mirror_new)
                    except StagedWriteError:
                        continue
                    t.tensor.set_(new)
                    stats["set_"] += 1
                else:

                    def lib_resize(t=t, new=new):
                        t.tensor = new

                    both(b, lib_resize, lambda r=r, m=mirror_new: r.replace(m), f"{t.name}.tensor = new {shape}")
                    stats["resizes"] += 1
            else:  # the block tables
                req = int(rng.integers(0, 4))
                if rng.random() < 0.1:
                    bt.clear_staged_writes()
                    ref.clear_staged_writes()
                    stats["bt_clears"] += 1
                    continue
                overwrite = bool(rng.random() < 0.3)
                ids = tuple([int(x) for x in rng.integers(0, 5000, int(rng.integers(0, 3)))] for _ in range(2))
                if rng.random() < 0.05:
                    ids = ([-1], [])  # refused by both
                call = (req, ids, overwrite)
                both(b, lambda c=call: bt.append_block_ids(*c), lambda c=call: ref.append_block_ids(*c),
                     f"append_block_ids{call}")  # fmt: skip
                stats["appends"] += 1
                if not np.array_equal(bt.num_blocks, ref.num_blocks):
                    fail(b, f"host num_blocks {bt.num_blocks.tolist()} != {ref.num_blocks.tolist()}")
        chosen = [p for p in pairs if rng.random() < 0.6] if rng.random() < 0.3 else list(pairs)
        stats["partial"] += len(chosen) < len(pairs)
        tables = [t for t, _ in chosen]
        if engine_args and tables:
            if rng.random() < 0.3:
                tables = tables + [tables[int(rng.integers(0, len(tables)))]]
            if rng.random() < 0.3:
                tables = iter(tables)
        writer.apply(tables)
        apply_staged_reference([r for _, r in chosen])
        if rng.random() < 0.7:
            bt.apply_staged_writes()
            ref.apply_staged_writes()
            for g in range(2):
                if not np.array_equal(host(bt[g].tensor), ref.tables[g]):
                    fail(b, f"group {g} differs:\n{host(bt[g].tensor)}\n{ref.tables[g]}")
            if not np.array_equal(host(bt.num_blocks_device), ref.num_blocks):
                fail(b, "num_blocks_device differs")
        for t, r in pairs:
            got = host(t.tensor)
            if not np.array_equal(got.view(np.uint8), r.table.view(np.uint8)):  # bit for bit
                fail(b, f"{t.name} {got.shape} {got.dtype} differs:\n{got}\n{r.table}")
            if t.num_staged_writes != r.num_staged_writes:
                fail(b, f"{t.name}: {t.num_staged_writes} staged after apply, reference {r.num_staged_writes}")
    return stats


#: The bounds `soak` asserts (growth from the warm-up snapshot to the end).
SOAK_FINALIZER_GROWTH = 4  # weakref.finalize registrations
SOAK_OBJECTS_PER_TYPE_GROWTH = 100  # live gc-tracked objects of any one type
SOAK_CACHE_BOUND = 64  # entries of any one container of the backend (or of an object one of them holds)
SOAK_MEMORY_GROWTH = 32 << 20  # bytes of `memory()`


def rss_bytes() -> int:
    """Resident set size of this process (Linux), 0 where /proc is missing."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096
    except OSError:
        return 0


def _containers(backend) -> dict[str, int]:
    """The length of every dict/list/set attribute of `backend`, and of the objects its dicts hold (a Triton
    backend's per-device state: descriptor cache, retiring rings, shared rings)."""
    out = {}
    for name, value in vars(backend).items():
        if isinstance(value, (dict, list, set)):
            out[name] = len(value)
        if isinstance(value, dict):
            for key, held in value.items():
                for inner, v in getattr(held, "__dict__", {}).items():
                    if isinstance(v, (dict, list, set)):
                        out[f"{name}[{key}].{inner}"] = len(v)
    return out


def _soak_snapshot(backend, memory) -> dict:
    import gc
    import weakref
    from collections import Counter

    if torch.cuda.is_available():
        torch.cuda.synchronize()  # launched kernels done: staging memory of dead arenas is released, then freed
    gc.collect()
    gc.collect()
    return {
        "finalizers": len(weakref.finalize._registry),  # type: ignore[attr-defined]  # CPython's registry
        "objects": Counter(type(o).__name__ for o in gc.get_objects()),
        "caches": _containers(backend),
        "memory": memory(),
    }


def soak(backend: str, device, applies: int, memory=rss_bytes) -> dict:
    """Run `applies` applies on `backend`; return the growth found, raising AssertionError past a bound.

    Each step: two requests appended to a long-lived `BlockTables` (overwritten when a row is full), then its apply;
    every other step a long-lived `StagedWriteTensor` written and applied, every 10th step together with a
    short-lived one of a shape of its own (a new table set); every 500th step a short-lived `BlockTables` applied
    once. Snapshots (after `gc.collect()`) after the first tenth of the applies and at the end: live
    `weakref.finalize` registrations, live objects per type, every container of the backend, `memory()`.
    """
    from multiwrite import BlockTables, FusedStagedWriter, StagedWriteTensor

    device = torch.device(device)
    writer = FusedStagedWriter(device, backend)
    instance = select_backend(device, backend)
    bt = BlockTables([16, 32], 8, [16, 8], device, kernel_block_sizes=[16, 16], backend=backend)
    long_lived = StagedWriteTensor((8, 16), torch.int64, device, name="long")
    counts = [0] * 8
    warmup = max(applies // 10, 1)
    first = None
    done = step = 0
    while done < applies:
        step += 1
        if first is None and done >= warmup:
            first = _soak_snapshot(instance, memory)
        for req in (step % 8, (step * 3 + 1) % 8):
            full = counts[req] >= 16
            bt.append_block_ids(req, ([step % 1000], [step % 500] if step % 2 else []), overwrite=full)
            counts[req] = 1 if full else counts[req] + 1
        bt.apply_staged_writes()
        done += 1
        if step % 2:
            long_lived.stage_write(step % 8, step % 15, [step, -step])
            if step % 10 == 1:
                short = StagedWriteTensor((2, 1 + step % 61), torch.int64, device, name="short")
                short.stage_write(1, 0, [step])
                writer.apply([long_lived, short])
                assert short.tensor[1, 0].item() == step
                del short
            else:
                writer.apply([long_lived])
            done += 1
        if step % 500 == 0:
            other = BlockTables([16], 2, [1 + step % 7], device, backend=backend)
            other.append_block_ids(1, ([step],), overwrite=True)
            other.apply_staged_writes()
            done += 1
            assert other[0].tensor[1, 0].item() == step
            del other
    assert first is not None
    last = _soak_snapshot(instance, memory)
    growth = {
        "finalizers": last["finalizers"] - first["finalizers"],
        "objects": {k: v for k, v in (last["objects"] - first["objects"]).items() if v > SOAK_OBJECTS_PER_TYPE_GROWTH},
        "caches": {k: v for k, v in last["caches"].items() if v > SOAK_CACHE_BOUND},
        "memory": last["memory"] - first["memory"],
    }
    assert growth["finalizers"] <= SOAK_FINALIZER_GROWTH, growth
    assert not growth["objects"], growth
    assert not growth["caches"], growth
    assert growth["memory"] <= SOAK_MEMORY_GROWTH, growth
    return growth


# -- plugins, cli, bench, packaging: fake installed distributions, fresh processes --------------------------------

#: The small trace of the command-line tests: 6 requests (`tests/data/small_trace.csv`).
SMALL_TRACE = str(Path(__file__).resolve().parent / "data" / "small_trace.csv")


def backend_source(cls: str, name: str, priority: int = 5, device_types: Sequence[str] = ("cpu",)) -> str:
    """Python source of a `Backend` subclass `cls` named `name` that applies through the built-in torch-cpu (for a
    fake plugin module; add the `multiwrite_backends` hook yourself)."""
    return textwrap.dedent(
        f"""
        from multiwrite import Backend, hookimpl

        class {cls}(Backend):
            NAME = {name!r}
            PRIORITY = {priority}
            SUPPORTED_DEVICE_TYPES = frozenset({sorted(device_types)!r})

            def apply(self, batches):
                from multiwrite import select_backend
                select_backend("cpu", "torch-cpu").apply(batches)
        """
    )


def install_distribution(
    root: Path, dist: str, module: str, source: str, entry: str | None = None, version: str = "1.0"
) -> None:
    """A fake installed distribution `dist` in the directory `root` (put it on `sys.path` or `PYTHONPATH`): the module
    `module` with `source`, and a `*.dist-info` whose entry point `entry` (default: `dist`) in the `multiwrite` group
    names the module."""
    root.mkdir(parents=True, exist_ok=True)
    (root / f"{module}.py").write_text(textwrap.dedent(source))
    info = root / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    (info / "entry_points.txt").write_text(f"[multiwrite]\n{entry or dist} = {module}\n")


def subprocess_env(*paths: Path | str, unbuffered: bool | None = None, **extra: str) -> dict[str, str]:
    """This process's environment for a child: `paths` first on `PYTHONPATH`, no `MULTIWRITE_BACKEND` (the child
    chooses as a user's program would), `PYTHONUNBUFFERED` set (True), removed (False) or as it is (None), and `extra`.
    """
    env = dict(os.environ, **extra)
    env.pop("MULTIWRITE_BACKEND", None)
    env["PYTHONPATH"] = os.pathsep.join([*map(str, paths), *filter(None, [os.environ.get("PYTHONPATH")])])
    if unbuffered is True:
        env["PYTHONUNBUFFERED"] = "1"
    elif unbuffered is False:
        env.pop("PYTHONUNBUFFERED", None)
    return env


def multiwrite_command() -> list[str]:
    """The installed `multiwrite` console script beside this interpreter (else on PATH), else `python -m multiwrite`."""
    script = Path(sys.executable).with_name("multiwrite")
    if script.exists():
        return [str(script)]
    found = shutil.which("multiwrite")
    return [found] if found else [sys.executable, "-m", "multiwrite"]


def run_multiwrite(*argv: str, env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """`multiwrite ARGV` in a fresh process (stdout and stderr captured as text)."""
    return subprocess.run([*multiwrite_command(), *argv], env=env or subprocess_env(), capture_output=True, text=True,
                          timeout=timeout)  # fmt: skip


def one_line_error(stderr: str) -> str:
    """The single line of an error report on stderr (asserts one line and no traceback)."""
    assert "Traceback" not in stderr, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    return lines[0]


def run_interleaved(worker: Callable[[int], None], threads: int = 8) -> None:
    """Run `worker(seed)` for seeds 0..threads-1 on that many threads at once, switching threads as often as
    Python allows (so that their staging and applies interleave), and wait for all of them."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    try:
        started = [threading.Thread(target=worker, args=(seed,)) for seed in range(threads)]
        for t in started:
            t.start()
        for t in started:
            t.join()
    finally:
        sys.setswitchinterval(interval)


def triton_importable() -> bool:
    """Whether Triton imports here (the Triton rooms' tests are not collected without it)."""
    try:
        import triton  # noqa: F401
    except ImportError:  # pragma: no cover - depends on the environment
        return False
    return True


def skip_off_interpreter(items: list, selected: Callable[[Path], bool], reason: str) -> None:
    """Skip the collected `items` whose file `selected` picks when Triton's interpreter is off (a GPU machine):
    they run the Triton kernels on CPU tables."""
    from multiwrite.backends.triton.backend import interpreter_enabled

    if not triton_importable() or interpreter_enabled():
        return
    import pytest

    skip = pytest.mark.skip(reason=f"Triton's interpreter is off (a GPU machine): {reason}")
    for item in items:
        if selected(Path(str(item.path)).resolve()):
            item.add_marker(skip)


# -- examples, gpu: the example scripts as modules -----------------------------------------------------------------

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def load_example(name: str, module_name: str) -> ModuleType:
    """`examples/<name>.py` imported as the module `module_name` (registered in `sys.modules`, as dataclasses need)."""
    spec = importlib.util.spec_from_file_location(module_name, EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return module
