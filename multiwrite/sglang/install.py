"""Put multiwrite's page-table writers in SGLang 0.5.23 (docs/sglang.md).

`install()` checks SGLang's `sglang.srt.mem_cache.allocation` first: the parameters of `write_cache_indices` and of
the functions the decode allocation calls, and the statements of `alloc_for_decode_default` and `alloc_for_decode`
(the decode function registered here repeats SGLang's steps around its write, so a SGLang whose steps differ is
refused rather than half-followed). It then rebinds `write_cache_indices` in that module (and in any `sglang` module
that imported SGLang's function) and registers, for device type `cuda`, `alloc_for_decode` below in
`ALLOC_FOR_DECODE_FUNCS`. What differs is named, and nothing is replaced.
"""

from __future__ import annotations

import ast
import hashlib
import importlib
import inspect
import logging
import sys
import textwrap
from typing import Any

__all__ = ["UnsupportedSglangError", "alloc_for_decode", "install", "signature_differences", "uninstall"]

logger = logging.getLogger("multiwrite.sglang")

ALLOCATION_MODULE = "sglang.srt.mem_cache.allocation"
DEVICE_TYPE = "cuda"
_REQUIRED = inspect.Parameter.empty

#: SGLang 0.5.23's functions that `install()` replaces or calls: (parameter name, default or `_REQUIRED`), all
#: positional-or-keyword.
SIGNATURES: dict[str, tuple[tuple[str, Any], ...]] = {
    "write_cache_indices": tuple((name, _REQUIRED) for name in (
        "out_cache_loc", "req_pool_indices_tensor", "req_pool_indices_cpu", "prefix_lens_tensor", "prefix_lens_cpu",
        "seq_lens_tensor", "seq_lens_cpu", "extend_lens_tensor", "extend_lens_cpu", "prefix_tensors",
        "req_to_token_pool")),  # fmt: skip
    "alloc_for_decode_default": (("batch", _REQUIRED), ("token_per_req", _REQUIRED)),
    "alloc_for_decode": (("batch", _REQUIRED), ("token_per_req", _REQUIRED)),
    "alloc_token_slots": (("tree_cache", _REQUIRED), ("num_tokens", _REQUIRED)),
    "alloc_paged_token_slots_decode": (("tree_cache", _REQUIRED), ("seq_lens", _REQUIRED), ("seq_lens_cpu", _REQUIRED),
                                       ("last_loc", _REQUIRED), ("token_per_req", 1), ("req_pool_indices", None),
                                       ("batch", None)),  # fmt: skip
    "_alloc_page_size": (("batch", _REQUIRED),),
}

#: sha256 of the statements of SGLang 0.5.23's functions that `alloc_for_decode` below follows (`body_digest`:
#: `ast.unparse` of the body without its docstring, so comments and formatting do not count).
BODY_DIGESTS = {
    "alloc_for_decode_default": "013c5bd262b68a8515c888972a3e954c8754495d9ab3b8cf1047297aceec651f",
    "alloc_for_decode": "e14e07968e1e0692556511116965c6e104cc6729d2f9fc7db338151102e9229f",
}

_installed: dict[str, Any] | None = None  # what install() replaced: SGLang's function, and whether cuda was registered


class UnsupportedSglangError(RuntimeError):
    """SGLang's allocation module is missing or not the one multiwrite's writers replace (SGLang 0.5.23's); the
    message names each difference. Nothing was replaced."""


def body_digest(func: Any) -> str | None:
    """sha256 of `func`'s statements (`ast.unparse`, docstring left out), or None when its source cannot be read."""
    try:
        source = textwrap.dedent(inspect.getsource(func))
    except (OSError, TypeError):
        return None
    node = ast.parse(source).body[0]
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return None
    body = node.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    return hashlib.sha256(ast.unparse(ast.Module(body=body, type_ignores=[])).encode()).hexdigest()


def _default(value: Any) -> str:
    return "no default (required)" if value is _REQUIRED else f"default {value!r}"


def signature_differences(module: Any) -> list[str]:
    """How `module` differs from SGLang 0.5.23's `sglang.srt.mem_cache.allocation` where multiwrite depends on it
    (an empty list when it does not): each entry names the function or parameter, what 0.5.23 has and what
    `module` has."""
    diffs: list[str] = []
    for name, expected in SIGNATURES.items():
        func = getattr(module, name, None)
        if not callable(func):
            diffs.append(f"{ALLOCATION_MODULE} lacks function {name!r}")
            continue
        try:
            params = list(inspect.signature(func).parameters.values())
        except (TypeError, ValueError):
            diffs.append(f"{name} has no inspectable signature")
            continue
        got = [(p.name, p.default) for p in params]
        want_names, got_names = [n for n, _ in expected], [n for n, _ in got]
        if got_names != want_names:
            diffs.append(f"{name} takes ({', '.join(got_names)}), expected ({', '.join(want_names)})")
            continue
        for p, (pname, default) in zip(params, expected):
            if p.kind is not inspect.Parameter.POSITIONAL_OR_KEYWORD:
                diffs.append(f"{name}: parameter {pname!r} is {p.kind.description}, expected positional or keyword")
            if not (p.default is default or (type(p.default) is type(default) and p.default == default)):
                diffs.append(f"{name}: parameter {pname!r} has {_default(p.default)}, expected {_default(default)}")
    for name, digest in BODY_DIGESTS.items():
        func = getattr(module, name, None)
        if callable(func):
            got = body_digest(func)
            if got is None:
                diffs.append(f"{name}: its source cannot be read, to compare its statements with SGLang 0.5.23's")
            elif got != digest:
                diffs.append(f"{name}: its statements differ from SGLang 0.5.23's (sha256 {got[:12]}, expected "
                             f"{digest[:12]}): multiwrite's decode function repeats them around its write")  # fmt: skip
    funcs = getattr(module, "ALLOC_FOR_DECODE_FUNCS", None)
    if funcs is None or not callable(getattr(funcs, "__setitem__", None)):
        diffs.append(f"{ALLOCATION_MODULE} has no ALLOC_FOR_DECODE_FUNCS registry (a dict by device type)")
    elif funcs.get(DEVICE_TYPE) not in (None, alloc_for_decode, getattr(module, "alloc_for_decode_default", None)):
        # (SGLang's default lands there too: a lookup of the defaultdict inserts it)
        diffs.append(f"ALLOC_FOR_DECODE_FUNCS[{DEVICE_TYPE!r}] is already {funcs[DEVICE_TYPE]!r} (another plugin's)")
    return diffs


def _import_failure(e: ImportError) -> str:
    missing = e.name if isinstance(e, ModuleNotFoundError) else None
    if missing == "sglang":
        return f"SGLang is not installed (cannot import {ALLOCATION_MODULE}: {e})"
    cause = f"module {missing!r} is missing" if missing else f"{type(e).__name__}: {e}"
    return (f"cannot import {ALLOCATION_MODULE}: SGLang is installed but it failed to import ({cause}; importing "
            f"{ALLOCATION_MODULE} yourself shows the traceback)")  # fmt: skip


def _sglang_namespaces() -> list[dict]:
    return [vars(m) for name, m in list(sys.modules.items())
            if name.split(".")[0] == "sglang" and isinstance(getattr(m, "__dict__", None), dict)]  # fmt: skip


def install() -> list[str]:
    """Rebind `write_cache_indices` to `multiwrite.sglang.write_cache_indices` in SGLang's allocation module and in
    every `sglang` module already imported that holds SGLang's function, and register `alloc_for_decode` for
    `cuda` in `ALLOC_FOR_DECODE_FUNCS`.

    Returns what was replaced (`write_cache_indices`, `ALLOC_FOR_DECODE_FUNCS['cuda']`); none when multiwrite's are
    already in place (calling it again is harmless). Raises `UnsupportedSglangError`, replacing nothing, when the
    module does not import (SGLang absent or failing to import) or differs from SGLang 0.5.23's
    (`signature_differences`, every difference named).
    """
    global _installed
    try:
        module = importlib.import_module(ALLOCATION_MODULE)
    except ImportError as e:
        raise UnsupportedSglangError(f"multiwrite.sglang.install(): {_import_failure(e)}") from e
    from multiwrite.sglang.writes import write_cache_indices

    if module.__dict__.get("write_cache_indices") is write_cache_indices:
        return []
    diffs = signature_differences(module)
    if diffs:
        raise UnsupportedSglangError(
            f"multiwrite.sglang.install(): {ALLOCATION_MODULE} is not SGLang 0.5.23's where multiwrite replaces its "
            "writers, nothing was replaced: " + "; ".join(diffs)
        )
    theirs = module.write_cache_indices
    holders = [ns for ns in _sglang_namespaces() if ns.get("write_cache_indices") is theirs]
    for ns in holders:
        ns["write_cache_indices"] = write_cache_indices
    funcs = module.ALLOC_FOR_DECODE_FUNCS
    _installed = {"module": module, "write_cache_indices": theirs, "holders": holders, "decode": funcs.get(DEVICE_TYPE)}
    funcs[DEVICE_TYPE] = alloc_for_decode
    logger.info("multiwrite.sglang: write_cache_indices replaced and ALLOC_FOR_DECODE_FUNCS[%r] registered in %s",
                DEVICE_TYPE, ALLOCATION_MODULE)  # fmt: skip
    return ["write_cache_indices", f"ALLOC_FOR_DECODE_FUNCS[{DEVICE_TYPE!r}]"]


def uninstall() -> list[str]:
    """Put SGLang's `write_cache_indices` back wherever `install()` bound multiwrite's and `ALLOC_FOR_DECODE_FUNCS`'s
    `cuda` entry as it was (none: SGLang's default then serves it again); returns what was put back (nothing if
    `install()` replaced nothing in this process)."""
    global _installed
    if _installed is None:
        return []
    from multiwrite.sglang.writes import write_cache_indices

    for ns in _installed["holders"] + _sglang_namespaces():  # (and modules that imported ours since)
        if ns.get("write_cache_indices") is write_cache_indices:
            ns["write_cache_indices"] = _installed["write_cache_indices"]
    funcs = _installed["module"].ALLOC_FOR_DECODE_FUNCS
    if funcs.get(DEVICE_TYPE) is alloc_for_decode:
        if _installed["decode"] is None:
            del funcs[DEVICE_TYPE]
        else:
            funcs[DEVICE_TYPE] = _installed["decode"]
    _installed = None
    return ["write_cache_indices", f"ALLOC_FOR_DECODE_FUNCS[{DEVICE_TYPE!r}]"]


def alloc_for_decode(batch: Any, token_per_req: int) -> Any:
    """SGLang 0.5.23's decode allocation (`alloc_for_decode_default`) with its page-table write done by
    `multiwrite.sglang.write_decode` (one launch, no int32 copy of `out_cache_loc`, no copy of `seq_lens`): SWA
    eviction, SGLang's own slot allocation (paged: after reading each request's last slot, which the allocator
    needs before it runs, so that read cannot join the write's launch), the write at `seq_lens` (plus
    `encoder_lens` for an encoder-decoder; checked on the host against `req_pool_indices_cpu` and `seq_lens_cpu`
    except for an encoder-decoder, whose bad writes are skipped on the device), SGLang's auxiliary lengths (freeing
    the slots if that fails) and the requests' KV counters. Returns `out_cache_loc`. Registered for `cuda` only,
    so SGLang's NPU hook never applies.
    """
    from multiwrite.sglang.writes import write_decode

    allocation = sys.modules[ALLOCATION_MODULE]
    batch.maybe_evict_swa()
    seq_lens = batch.seq_lens
    bs = seq_lens.shape[0]
    if allocation._alloc_page_size(batch) == 1:
        out_cache_loc = allocation.alloc_token_slots(batch.tree_cache, bs * token_per_req)
    else:
        last_loc = batch.req_to_token_pool.req_to_token[batch.req_pool_indices, seq_lens - 1]
        out_cache_loc = allocation.alloc_paged_token_slots_decode(
            tree_cache=batch.tree_cache,
            seq_lens=seq_lens + token_per_req,
            seq_lens_cpu=batch.seq_lens_cpu + token_per_req,
            last_loc=last_loc,
            token_per_req=token_per_req,
            req_pool_indices=batch.req_pool_indices,
            batch=batch,
        )
    locs = batch.encoder_lens + seq_lens if batch.model_config.is_encoder_decoder else seq_lens
    # SGLang keeps the CPU copies equal to the device tensors (its auxiliary lengths below are computed from them):
    # with them every write is checked on the host, without a synchronization.
    host = {} if batch.model_config.is_encoder_decoder else dict(
        req_pool_indices_cpu=batch.req_pool_indices_cpu, locs_cpu=batch.seq_lens_cpu)
    write_decode(batch.req_to_token_pool, batch.req_pool_indices, locs, out_cache_loc, **host)
    try:
        batch.req_to_token_pool.alloc_aux_to_lengths(
            req_pool_indices_cpu=batch.req_pool_indices_cpu, target_seq_lens_cpu=batch.seq_lens_cpu + token_per_req
        )
    except Exception:
        batch.tree_cache.token_to_kv_pool_allocator.free(out_cache_loc)
        raise
    for req in batch.reqs:
        req.kv.kv_allocated_len += token_per_req
        req.kv.kv_committed_len += token_per_req
    return out_cache_loc
