"""``fastload.dali``: DALI pipelines with fastload's batch contract (see ``fastload.load.dali``).

Importing this module does not import DALI; constructing a ``DALILoader`` without the
``dali`` extra raises ``MissingDependencyError`` with the pip command.

Must not: hold code of its own (the pipelines live in ``load/dali.py``).
"""

from fastload.load.dali import DALILoader, DALIOptions, dali_available

__all__ = ["DALILoader", "DALIOptions", "dali_available"]
