"""``fastload.profiling``: where the user's own, unmodified training step waits.

``fastload profile -- COMMAND``, ``watch()`` and ``profile()``; the probe injected into the user's
interpreters; the verdict, the gain model and the recommendations. It stands above ``measure/``:
the report quotes ``measure/doctor.py``'s machine facts. Its modules: docs/layout.md.

Must not: import anything at package import time (``sitecustomize`` imports ``_probe`` in
every interpreter the user's command starts; ``fastload.profile`` is the public name); hold
benchmarks (``bench/profile.py`` measures the probe's overhead).
"""
