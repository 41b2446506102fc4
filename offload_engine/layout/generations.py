"""The names in a checkpoint directory (docs/format.md, "Checkpoints").

```
<ckpt_dir>/
  latest                       text: the name of the newest committed generation
  step-00000030/               a committed generation (a zarr v3 group; tensor table in zarr.json)
    rank0/                     rank 0's arrays; its shard table in rank0/zarr.json
  step-00000040.partial/       a generation being written, or torn by a crash: never loaded
  step-00000040.superseded-1/  a committed generation latest did not name, set aside when
                               its step was saved again: kept, never loaded
  step-00000010.deleting/      a generation keep_last is removing: never loaded
  best/                        a generation saved with tag="best" (any checked name)
```

A generation is written under ``<name>.partial`` and renamed to ``<name>`` when complete
(the commit point); ``latest`` is replaced after. Writing is ``checkpoint/commit.py``,
reading ``formats/ours/generations.py``.
"""

from __future__ import annotations

import re

PARTIAL = ".partial"
LATEST = "latest"
# <name>.superseded-<k>: a generation that latest did not name when its step was saved
# again (an orphan of a crash between commit and latest, or of a rollback); never loaded
SUPERSEDED = ".superseded-"
# <name>.deleting: a generation retention (keep_last) is removing; never loaded, and swept
# by the next save's retention when a crash left it half removed
DELETING = ".deleting"


def generation_name(step: int) -> str:
    """The directory name of the generation saved at ``step``."""
    return f"step-{step:08d}"


_GENERATION = re.compile(r"step-\d{8,}")


def is_generation_name(name: str) -> bool:
    """Whether ``name`` is a committed generation's directory name (``step-<8+ digits>``)."""
    return _GENERATION.fullmatch(name) is not None
