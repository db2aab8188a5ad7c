"""Writing export files: safetensors with the usual permissions, and clearing an export folder for --overwrite."""

from __future__ import annotations

import os
import shutil
from typing import Any, Dict, List


def _umask() -> int:
    """The process umask, read without changing it (os.umask would, and exports may run in threads)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    return 0o022


def save_safetensors(tensors: Dict[str, Any], path: str) -> None:
    """safetensors' ``save_file`` creates its file 0600; give it the mode every other file gets (0666 & ~umask)."""
    from safetensors.torch import save_file

    save_file(tensors, path, metadata={"format": "pt"})
    os.chmod(path, 0o666 & ~_umask())


def clear_export_dir(out_dir: str) -> List[str]:
    """Remove what an earlier export left in ``out_dir`` (model files and its ``lev/`` folder); return the names."""
    removed = []
    for name in sorted(os.listdir(out_dir)):
        path = os.path.join(out_dir, name)
        if name.startswith("model") and name.endswith((".safetensors", ".json")):
            os.remove(path)
        elif name == "lev" and os.path.isdir(path):
            shutil.rmtree(path)
        else:
            continue
        removed.append(name)
    return removed
