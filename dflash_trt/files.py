"""Files written atomically: a reader sees the old file or the new one, never a part (tmp + os.replace)."""
from __future__ import annotations

import json
import os


def write_json(path: str, data, indent: int | None = 1) -> str:
    """json.dump `data` to `path` atomically; the temp name is unique, so concurrent writers never share it."""
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}.{os.urandom(4).hex()}"
    try:
        with open(tmp, "w") as f:
            json.dump(data, f, indent=indent)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    return path
