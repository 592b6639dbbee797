"""The configuration table (native/config.cc) is the one list of SMDDP_* variables: every name
the tree reads or sets is in it, with a meaning (in process, no ranks)."""
import re
from pathlib import Path

from smdistributed.common.config import config_table, default_bucket_bytes

ROOT = Path(__file__).resolve().parent.parent
# Names that are not environment variables: C macros of the core's headers.
NOT_VARIABLES = {"SMDDP_LOG", "SMDDP_C_API_H", "SMDDP_C_API_VERSION", "SMDDP_C_API_CAPSULE"}


def test_every_smddp_variable_in_the_tree_is_in_the_table():
    table = {name: meaning for name, _, meaning in config_table()}
    used = set()
    for folder in ("native", "common", "frontends", "examples", "bench"):
        for path in (ROOT / folder).rglob("*"):
            if path.suffix in (".py", ".cc", ".h"):
                used |= set(re.findall(r"\bSMDDP_[A-Z0-9_]*[A-Z0-9]\b", path.read_text()))
    missing = sorted(used - NOT_VARIABLES - set(table))
    assert not missing, f"SMDDP_ names used in the tree but missing from native/config.cc: {missing}"
    assert all(meaning.strip() for meaning in table.values())


def test_one_default_bucket():
    assert default_bucket_bytes() == 25 << 20  # the original library's 25 MB bucket_cap_mb
