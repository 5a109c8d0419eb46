"""``fastload.bench``: every side-by-side benchmark, the top room of the library.

Owns: ``fastload bench loader | decode | encode | convert | serve`` (``loader.py`` with the
bench-only paths, SPDL in ``_spdl_path.py``; ``decode.py``; ``encode.py``; ``convert.py``;
``serve.py`` and ``fronts.py`` for the serving fronts) and the profiler's overhead
(``profile.py``). Benchmarks build on everything below them: the A/B stages and timing of
``measure/``, the profiler of ``profiling/``, the server of ``serve/``.

Must not: be imported by any other room (only ``cli/`` and ``tools/`` call it); assert
performance (tests check shapes and that every arm ran, never a speed).
"""
