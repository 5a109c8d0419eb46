"""A conversion worker handler that segfaults on files named crash_*: a native decoder crash."""

import ctypes
import os

from fastload.pack.work import prepare_item as real


def prepare_item(path: str, options):
    if os.path.basename(path).startswith("crash_"):
        ctypes.string_at(0)  # SIGSEGV, exactly like a bug in a C decoder
    return real(path, options)
