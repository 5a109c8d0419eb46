"""Bytes to pixels, one policy for every room: ``policy.py`` (reference decode, sniffing,
the bomb limit, what may be stored as-is) and ``fast.py`` (the fast CPU decoders)."""
