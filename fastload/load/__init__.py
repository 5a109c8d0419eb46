"""``fastload.load``: from a store to batches on the device.

Owns: the dataset (``dataset.py``), the preset contract and presets (``transforms.py``),
the skip policy (``skips.py``), worker sizing (``workers.py``), the drop-in ``DataLoader``
(``loader.py``, with resume in ``state.py`` and ``_resume_iter.py``, threads in
``threads.py``), the device prefetcher (``prefetch.py``) and the DALI pipelines
(``dali.py``, ``_dali_source.py``, imported only when used).

Must not: import anything at package import time (``import fastload`` stays light), or
import ``measure/``, ``serve/`` or any room above it.
"""
