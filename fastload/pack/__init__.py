"""``fastload.pack``: datasets into a store, offline and once.

Owns: reading sources (``sources.py``: ImageFolder trees and file lists) and the
conversion (``convert.py``: validate and canonicalise in crash-isolated workers, commit
through ``store/writer.py``, resume, report).

Must not: import anything at package import time, or import ``load/`` or any room above.
"""
