"""The on-disk contract of a fastload store: ``format.py`` (pure layout), ``writer.py``,
``reader.py`` (the hot read path and its handle cache) and ``check.py`` (inspect, verify)."""
