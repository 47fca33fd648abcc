"""The research data sets prepared outside the package (`../shared/data`, its README.md): Multi30k and SST-2.

They are for research use and never copied into the package; CI has them. A test that needs one asks
`shared_data(name)`, which skips it, saying why, where the folder is absent. PLAINFORMER_SHARED_DATA names
another place for the folder.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

SHARED_DATA = Path(os.environ.get("PLAINFORMER_SHARED_DATA",
                                  Path(__file__).resolve().parents[2].parent / "shared" / "data"))


def shared_data(name: str) -> Path:
    """The folder `name` of the shared data (multi30k, sst2), or the calling test skipped."""
    path = SHARED_DATA / name
    if not path.is_dir():
        pytest.skip(f"{path} is absent: the research data set {name!r} is kept outside the package "
                    "(../shared/data, see its README.md; CI has it)")
    return path
