"""``fastload.bench``: every side-by-side benchmark, the top room of the library.

Benchmarks build on everything below them: the A/B stages and timing of ``measure/``, the
profiler of ``profiling/``, the server of ``serve/``. Its modules: docs/layout.md.

Must not: be imported by any other room (only ``cli/`` and ``tools/`` call it); assert
performance (tests check shapes and that every arm ran, never a speed).
"""
