"""The Hugging Face files that make a consolidated folder loadable by ``from_pretrained``
(config.json, generation_config.json, tokenizer files), copied from beside the checkpoint.

The Hugging Face Trainer saves them in the checkpoint folder, next to ``latest`` and the
tag folders; a user may put them there by hand. They are looked for in SRC and, when SRC is
a generation or tag folder, in the folder above it.
"""

from __future__ import annotations

import fnmatch
import os
import shutil

from ..layout.metadata import replacing

# fnmatch patterns of the files from_pretrained and AutoTokenizer / AutoProcessor read
EXTRA_PATTERNS = ("config.json", "generation_config.json", "tokenizer.json",
                  "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
                  "added_tokens.json", "vocab.json", "vocab.txt", "merges.txt", "spiece.model",
                  "chat_template.json", "chat_template.jinja", "preprocessor_config.json",
                  "processor_config.json")


def find_extras(src: str) -> list[str]:
    """Paths of the Hugging Face side files beside checkpoint ``src`` (SRC as given), each
    name once: SRC's own first, then its parent's when SRC is a generation or tag folder
    (a folder without ``latest``)."""
    src = os.path.abspath(src)
    if not os.path.isdir(src):
        src = os.path.dirname(src)
    folders = [src]
    if not os.path.exists(os.path.join(src, "latest")):
        folders.append(os.path.dirname(src))
    found: dict[str, str] = {}
    for folder in folders:
        try:
            names = sorted(os.listdir(folder))
        except OSError:
            continue
        for name in names:
            path = os.path.join(folder, name)
            if (name not in found and os.path.isfile(path)
                    and any(fnmatch.fnmatchcase(name, p) for p in EXTRA_PATTERNS)):
                found[name] = path
    return list(found.values())


def copy_extras(paths: list[str], out_dir: str) -> list[str]:
    """Copy each file into ``out_dir`` (replacing one of the same name, atomically: a
    reader sees the old file or the new, whole). Returns the names copied."""
    names = []
    for path in paths:
        name = os.path.basename(path)
        with replacing(os.path.join(out_dir, name)) as tmp:
            shutil.copyfile(path, tmp)
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
        names.append(name)
    return names
