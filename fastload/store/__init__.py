"""The on-disk contract of a fastload store: ``format.py`` (pure layout), ``writer.py``,
``reader.py`` (the hot read path and its handle cache) and ``check.py`` (inspect, verify);
``manifest.py`` and ``remote.py`` for sharded stores and object storage.

Must not: decode for training, or import ``pack/``, ``load/`` or anything above."""
