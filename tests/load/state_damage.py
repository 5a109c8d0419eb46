"""Damage one field of a saved loader state, as a hand edit or a truncated file would: shared by the
hand-edited-state tables of ``test_resume_state.py`` (DataLoader) and ``test_resume_dali.py`` (DALILoader)."""

from __future__ import annotations

WRONG = "abc"


def damage(sd: dict, path: tuple, how: str, str_fields: set[tuple]) -> dict | None:
    """``sd`` with the field at ``path`` damaged ``how`` (missing, none, type, truncated); None when
    the state has no such field or the damage does not apply. ``str_fields``: the fields that hold
    text, which get an int as their wrong type."""
    path = tuple(k for k in path if k != "")  # ("generator", ""): the same field, another row
    parent = sd
    for k in path[:-1]:
        parent = parent[k]
    key = path[-1]
    if key not in parent:
        return None
    value = parent[key]
    if how == "missing":
        del parent[key]
    elif how == "none":
        parent[key] = None
    elif how == "type":
        parent[key] = 12345 if path in str_fields else WRONG
    elif how == "truncated":
        if isinstance(value, (bytes, bytearray)):
            parent[key] = value[: len(value) // 2]
        elif isinstance(value, str) and path[0] in ("generator", "order"):  # an RNG state's base64
            parent[key] = value[: len(value) // 8 * 4]
        elif isinstance(value, list):
            parent[key] = value[:-1]
        else:
            return None
    return sd
