"""``fastload.pack``: datasets into a store, offline and once: reading sources (folders, file lists,
tar shards, Parquet, local or in a bucket), the conversion, and sharded conversion on an engine
(``local`` or ``ray``). Its modules: docs/layout.md.

Must not: import anything at package import time, or import ``load/`` or any room above.
"""
