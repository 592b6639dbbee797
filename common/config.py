"""The configuration table (name, default, meaning) as the native core declares it.

The table lives once, in native/config.cc; this module only reads and formats it.
"""
from typing import List, Tuple


def config_table() -> List[Tuple[str, str, str]]:
    from smdistributed import _core

    return list(_core.config_table())


def default(name: str) -> str:
    """The table's default for `name` (not the environment's value)."""
    for row_name, value, _ in config_table():
        if row_name == name:
            return value
    raise KeyError(f"{name} is not in the configuration table (native/config.cc)")


def default_bucket_bytes() -> int:
    """The one default bucket size (SMDDP_FUSION_THRESHOLD's: the original's 25 MB), which the
    frontends' bucket_cap_mb defaults follow."""
    return int(default("SMDDP_FUSION_THRESHOLD"))


def format_config_table(width: int = 100) -> str:
    import textwrap

    lines = ["Configuration variables (environment):"]
    for name, default, meaning in config_table():
        shown = default if default != "" else "(unset)"
        lines.append(f"  {name} = {shown}")
        for chunk in textwrap.wrap(meaning, width - 6):
            lines.append("      " + chunk)
    return "\n".join(lines)


def value(name: str) -> str:
    """The environment's value of a table variable, or the table's default. Names outside the
    table are refused, so every knob a package reads is listed (and shown by smddprun --help)."""
    import os

    fallback = default(name)
    return os.environ.get(name, fallback)
