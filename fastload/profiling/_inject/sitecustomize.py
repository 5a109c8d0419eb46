"""Injected by ``fastload profile`` (first on the child's PYTHONPATH): start the probe in this interpreter.

Python imports ``sitecustomize`` once at start-up. This one first imports the user's own
``sitecustomize`` (the next one on ``sys.path``) so their set-up still runs, then starts
``fastload.profiling._probe`` configured by the ``FASTLOAD_PROFILE_*`` environment. Any failure
here is reported on stderr and never stops the user's program.

Must not: raise into the user's program, or import torch itself (the probe waits for the
script to import it).
"""

import importlib
import os
import sys

_here = os.path.dirname(os.path.abspath(__file__))


def _chain_user_sitecustomize() -> None:
    saved = sys.path[:]
    me = sys.modules.pop("sitecustomize", None)
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _here]
    try:
        importlib.import_module("sitecustomize")
    except ModuleNotFoundError as exc:
        if exc.name != "sitecustomize":
            raise
        if me is not None:
            sys.modules["sitecustomize"] = me
    finally:
        sys.path[:] = saved


def _start() -> None:
    try:
        import fastload  # noqa: F401
    except ImportError:  # fastload lives next to this folder: fastload/profiling/_inject
        sys.path.append(os.path.dirname(os.path.dirname(os.path.dirname(_here))))
    from fastload.profiling import _probe

    _probe.install_from_env()


try:
    _chain_user_sitecustomize()
except Exception as exc:  # the user's sitecustomize failed: say so, as Python would, and go on
    print(f"sitecustomize (yours, chained by fastload profile) failed: {exc!r}", file=sys.stderr)
try:
    _start()
except Exception as exc:
    print(f"fastload profile: could not instrument this process: {exc!r}", file=sys.stderr)
