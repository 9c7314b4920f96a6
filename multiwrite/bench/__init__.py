"""`multiwrite bench`: the fused writer side by side with per-group and naive writes on the real trace.

Modules, lowest first: `floor_kernel` (the empty Triton kernel of the GPU floor), `variants` (the designs
compared and their check against the reference), `runner` (the timed replay and the prefill burst),
`captured` (batches captured from the trace, applied alone), `launch` (`--launch`: the Triton launch itself),
`anchor_kernels` and `stage` (`--stage`: the whole block-table stage of a step), `glossary` (the terms every
output defines), `report` (terminal tables, goals, CSV), `plot` (the figure). The subcommand itself (options,
checks, the run) is `multiwrite.cli.bench`. Nothing here is imported by the library itself.
"""
