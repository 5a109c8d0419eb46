"""Bytes to pixels, one policy for every room: recognising bytes and raw records, damaged or odd
images, the reference decode and what is stored as-is, the fast CPU decoders. Its modules:
docs/layout.md.

Also the one named default image size: every preset, pipeline, benchmark and command that takes a
size defaults to ``DEFAULT_SIZE`` (ImageNet's 224-px crop; evaluation resizes the shorter side to
``DEFAULT_RESIZE`` first). Named here, the lowest room every one of them may import, and cheap to import.

Must not: import torch at import time or anything from the rooms above (``store/`` and up)."""

DEFAULT_SIZE = 224
DEFAULT_RESIZE = 256
