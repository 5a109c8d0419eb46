"""``fastload.measure``: the A/B runner — where does the training step wait, stage by stage?

Owns: the stages each A/B run compares (``stages.py``), a real instrumented training step
(``train.py``, ``timing.py``), TOML recipes run in interleaved rounds (``recipe.py``,
``rounds.py``, ``cache.py``), the reports (``report.py``), and the machine facts every
result is written beside (``env.py``, ``doctor.py``) with the measured ``--max-side``
advice (``advice.py``).

Must not: import ``profiling/``, ``bench/`` or ``serve/`` (they stand on it or beside it);
import anything at package import time.
"""
