"""Exceptions raised by multiwrite."""

from __future__ import annotations


class StagedWriteError(ValueError):
    """A staged write that cannot be applied to its table.

    Raised at stage time (a row outside the table, a negative start, a write past the row's width, a value
    the table's dtype cannot hold or a bool, a wrong number of KV-cache groups) or at apply time (a table
    on another device than the writer's, a table that shrank below its staged writes, a `BlockTables`
    group resized in place, tables of different dtypes over the same memory). The message names the table,
    row, start, length and shape involved. When it is raised nothing was staged or written, and every
    write staged before stays staged.
    """


class StageInputError(ValueError):
    """Inputs of `gather_block_tables`, `compute_slot_mappings` or `prepare_inputs` that cannot be used.

    Raised before anything is written or applied: the message names the argument, the value or shape found
    and what is accepted (e.g. a request row outside the tables, a padded count above the buffers, a token
    position past its table's row). Staged writes stay staged.
    """


class BackendUnavailableError(RuntimeError):
    """No backend can run the requested apply, or a forced backend cannot.

    The message lists each backend considered with the reasons it cannot run.
    """


class GraphCaptureError(RuntimeError):
    """An apply or clear was called while the current CUDA stream is being captured into a CUDA graph.

    An eager apply cannot be captured (its kernel reads a host ring slot by address, so a replay would
    write whatever batch sits there then). Raised before anything is recorded or changed: staged writes
    stay staged. Create the tables with `BlockTables(..., cuda_graphs=True)` to capture
    `apply_staged_writes()`, or apply outside the captured region.
    """


class ForkedCudaError(RuntimeError):
    """CUDA tables used in a process forked after its parent initialized CUDA (CUDA cannot work there).

    Start worker processes with the 'spawn' or 'forkserver' start method, or use CPU tables in the child.
    """


class BackendError(RuntimeError):
    """A backend failed while applying staged writes (`Backend.apply` raised).

    The message names the backend and the tables; the backend's own exception is the `__cause__`.
    Nothing staged was dropped: every write of the failed apply is still staged, so calling apply again
    (after fixing the cause) lands them all, in staging order, exactly once more; the tables may hold
    part of them meanwhile (a backend may fail after writing some tables). `BlockTables` keeps its host
    `num_blocks` as staged, and its staged `num_blocks` row travels with the retry, so host and device
    counts agree after it.

    Attributes:
        backend: the `Backend` that failed.
        tables: names of the tables of the failed apply, in argument order.
    """

    def __init__(self, message: str, backend: object = None, tables: tuple[str, ...] = ()):
        super().__init__(message)
        self.backend = backend
        self.tables = tables
