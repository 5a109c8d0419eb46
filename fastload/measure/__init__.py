"""``fastload.measure``: the A/B runner — where does the training step wait, stage by stage?

The stages each A/B run compares, a real instrumented training step, TOML recipes run in
interleaved rounds, the reports, and the machine facts every result is written beside. Its
modules: docs/layout.md.

Must not: import ``profiling/``, ``bench/`` or ``serve/`` (they stand on it or beside it);
import anything at package import time.
"""
