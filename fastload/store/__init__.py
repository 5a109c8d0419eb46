"""The on-disk contract of a fastload store: its format, writing, reading (local, or a sharded store
in a bucket through the node cache, behind one ``Reader`` seam), checking. Its modules:
docs/layout.md.

Must not: decode for training, or import ``pack/``, ``load/`` or anything above.
"""
