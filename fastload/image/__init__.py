"""Bytes to pixels, one policy for every room: ``formats.py`` (recognising bytes, raw records),
``damage.py`` (damaged or odd), ``policy.py`` (reference decode, the bomb limit, what is
stored as-is) and ``fast.py`` (the fast CPU decoders, thread-safe).

Must not: import torch at import time or anything from the rooms above (``store/`` and up)."""
