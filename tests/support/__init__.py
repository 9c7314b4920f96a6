"""Helpers shared by several rooms of the suite, a module by what it supports:

- `tables`: reading and comparing tables (`host`, `mismatches`), the CPU backend name, Hypothesis example counts;
- `backends`: backends that record or fail what they are handed (`RecordingBackend`, `HalfFailingBackend`);
- `threads`: running workers on interleaved threads;
- `fuzz`: the differential fuzz against `multiwrite.reference` (`run_fuzz`);
- `soak`: the long-running leak check (`soak`, `rss_bytes`);
- `interrupts`: the scenario of the interrupt tests, on CPU and GPU (`InterruptedTables`);
- `processes`: fresh `multiwrite` processes and their environment, the small trace;
- `distributions`: fake installed plugin distributions;
- `interpreter`: whether Triton imports and its interpreter runs the kernels;
- `example_scripts`: the example scripts imported as modules.

Append new helpers to the module they belong to (or a new module of your own); do not rewrite another room's helpers.
Nothing here reads a private attribute of a multiwrite object.
"""
