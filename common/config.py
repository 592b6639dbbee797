"""The configuration table (name, default, meaning) as the native core declares it.

The table lives once, in native/config.cc; this module only reads and formats it.
"""
from typing import List, Tuple


def config_table() -> List[Tuple[str, str, str]]:
    from smdistributed import _core

    return list(_core.config_table())


def format_config_table(width: int = 100) -> str:
    import textwrap

    lines = ["Configuration variables (environment):"]
    for name, default, meaning in config_table():
        shown = default if default != "" else "(unset)"
        lines.append(f"  {name} = {shown}")
        for chunk in textwrap.wrap(meaning, width - 6):
            lines.append("      " + chunk)
    return "\n".join(lines)
