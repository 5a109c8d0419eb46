"""``fastload.profiling``: where the user's own, unmodified training step waits.

Owns: ``fastload profile -- COMMAND``, ``watch()`` and ``profile()`` (``profile.py``), the
probe injected into the user's interpreters (``_inject/sitecustomize.py`` → ``_probe.py``,
``_samples.py``), the GPU-timeline interval arithmetic (``_kineto.py``) and the verdict,
gain model and outputs (``_profile_report.py``). It stands above ``measure/``: the report
quotes ``measure/doctor.py``'s machine facts.

Must not: import anything at package import time (``sitecustomize`` imports ``_probe`` in
every interpreter the user's command starts; ``fastload.profile`` is the public name); hold
benchmarks (``bench/profile.py`` measures the probe's overhead).
"""
