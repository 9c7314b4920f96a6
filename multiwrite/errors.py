"""Exceptions and warnings raised by multiwrite."""

from __future__ import annotations


class StagedWriteError(ValueError):
    """A staged write that cannot be applied to its table.

    Raised at stage time (a row outside the table, a negative start, a write past the row's width, a value
    the table's dtype cannot hold or a bool, a wrong number of KV-cache groups) or at apply time (a table
    on another device than the writer's, a table that shrank below its staged writes, a `BlockTables`
    table resized in place, tables of different dtypes over the same memory). The message names the table,
    row, start, length and shape involved. When it is raised nothing was staged or written, and every
    write staged before stays staged.
    """


class TableMovedError(StagedWriteError):
    """A table or output of a `BlockTables` (a group's table, `num_blocks_device`, `input_block_tables[g]`,
    `slot_mappings`) was re-pointed to other memory without a resize, e.g. by `tensor.data = other`: its `data_ptr()`
    is not the one it had at construction, where what keeps the addresses of construction (the Triton backends'
    descriptors, every captured launch) keeps reading and writing. The message names the tensor, both addresses and
    the call that found it; docs/lifecycle.md says when it is checked. Raised before the call stages, writes or
    records anything: every staged write stays staged (they land once the tensor points back, `tensor.data =
    original`).

    Attributes:
        what: the tensor, as the message names it (`"group 0 of a BlockTables"`).
        old, new: its address at construction and now.
    """

    def __init__(self, message: str, what: str = "", old: int = 0, new: int = 0):
        super().__init__(message)
        self.what, self.old, self.new = what, old, new


class BlockTableWriteError(StagedWriteError, RuntimeError):
    """`multiwrite.vllm.BlockTables.append_block_ids` refused a write (for example one past a row's capacity, naming
    request, group and capacity): a `StagedWriteError` that is also the `RuntimeError` vLLM 0.33's own class raises.
    Nothing of the call was staged, for any group.
    """


class StageInputError(ValueError):
    """Inputs of `gather_block_tables`, `compute_slot_mappings` or `prepare_inputs` that cannot be used.

    Raised before anything is written or applied: the message names the argument, the value or shape found
    and what is accepted (a request row outside the tables, a padded count above the buffers, a token
    position past its request's blocks). Staged writes stay staged.
    """


class BackendUnavailableError(RuntimeError):
    """No backend can run the requested work, or a forced backend cannot.

    The message lists each backend considered with the reasons it cannot run.
    """


class GraphCaptureError(RuntimeError):
    """A call that cannot be captured into a CUDA graph was made while the current stream captures one.

    Raised before anything is recorded or changed: staged writes stay staged. Create the tables with
    `BlockTables(..., cuda_graphs=True)` to capture the block-table stage (docs/graph-mode.md).
    """


class GraphProtocolError(RuntimeError):
    """Graph mode's commits and replays were mis-paired (docs/graph-mode.md, "Pairing is by count"): a replay ran
    without (or before) its `commit_staged_writes()`, or a commit had no replay issued before the next eager
    `apply_staged_writes()` / `prepare_inputs` (an extra commit, or an eager call between a commit and its replay).

    The device records the fault; the next commit or eager apply of the tables raises this once per fault, before
    it publishes or changes anything: the staged writes stay staged and every published batch still lands. The
    pairing is already restored: the next commit is the batch of the next replay to run.

    Attributes:
        replays_without_commit: replays that found their ticket unpublished since the last report (0: none).
        last_replay: the run index (0, 1, ...) of the last of them, or None.
        commits_without_replay: commits an eager run found with no replay since the last report (0: none).
        first_commit: the ticket index (the commit's number among commits, 0, 1, ...) of the first of the last such
            find, or None.
    """

    def __init__(self, message: str, replays_without_commit: int = 0, last_replay: int | None = None,
                 commits_without_replay: int = 0, first_commit: int | None = None):  # fmt: skip
        super().__init__(message)
        self.replays_without_commit = replays_without_commit
        self.last_replay = last_replay
        self.commits_without_replay = commits_without_replay
        self.first_commit = first_commit


class ForkedCudaError(RuntimeError):
    """CUDA tables used in a process forked after its parent initialized CUDA (CUDA cannot work there).

    Start worker processes with the 'spawn' or 'forkserver' start method, or use CPU tables in the child.
    """


class BackendError(RuntimeError):
    """A backend failed while applying staged writes.

    The message names the backend and the tables; the backend's own exception is the `__cause__`. Nothing
    staged was dropped: every write of the failed apply is still staged (and `BlockTables.num_blocks` keeps
    the staged counts), so calling apply again after fixing the cause lands them all, in staging order; the
    tables may hold part of them meanwhile.

    Attributes:
        backend: the `Backend` that failed.
        tables: names of the tables of the failed apply, in argument order.
    """

    def __init__(self, message: str, backend: object = None, tables: tuple[str, ...] = ()):
        super().__init__(message)
        self.backend = backend
        self.tables = tables


class RingWaitWarning(RuntimeWarning):
    """An apply or commit has waited longer than its warning threshold (1 s) for staging memory that a
    launched kernel still reads, or for a graph replay to consume a committed batch."""


class RingStallError(RuntimeError):
    """Staging memory (or a graph-mode header entry) was never released: the kernel that reads it did not run,
    even after waiting (and, outside a CUDA graph capture, a device synchronization). Nothing was applied or
    committed; the staged writes stay staged. The message names the memory and the likely cause."""


#: multiwrite's own errors: a job that raises one raises it as it is, not as a `BackendError` (a refusal, a stall).
OWN_ERRORS = (StagedWriteError, StageInputError, GraphCaptureError, GraphProtocolError, ForkedCudaError,
              RingStallError, BackendUnavailableError)  # fmt: skip
