"""The Hugging Face files that make a consolidated folder loadable by ``from_pretrained``
(config.json, generation_config.json, tokenizer files), copied from beside the checkpoint.

The Hugging Face Trainer saves them in the checkpoint folder, next to ``latest`` and the
tag folders; a user may put them there by hand. They are looked for in SRC and, when SRC is
a generation or tag folder, in the folder above it.

A checkpoint may come from someone else (docs/untrusted-input.md): a side file that is a
symlink leading out of its folder (``tokenizer.json -> ~/.ssh/id_rsa``) is not carried, and
a copied file keeps its source's permission bits, never more (a 0600 file stays 0600).
"""

from __future__ import annotations

import fnmatch
import logging
import os
import shutil
import stat

from ..layout.metadata import replacing

log = logging.getLogger(__name__)

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
            if name in found or not any(fnmatch.fnmatchcase(name, p) for p in EXTRA_PATTERNS):
                continue
            path = _inside(folder, name)
            if path is not None and os.path.isfile(path):
                found[name] = path
    return list(found.values())


def _inside(folder: str, name: str) -> str | None:
    """``folder/name`` with symlinks resolved, or None (logged) when it leads out of
    ``folder``: a link planted in a checkpoint must not carry a local file into the
    output."""
    path = os.path.join(folder, name)
    real = os.path.realpath(path)
    if real != path and not real.startswith(os.path.realpath(folder) + os.sep):
        log.warning("%s is a symlink leading out of its folder (to %s): not copied", path, real)
        return None
    return real


def copy_extras(paths: list[str], out_dir: str) -> list[str]:
    """Copy each file into ``out_dir`` (replacing one of the same name, atomically: a
    reader sees the old file or the new, whole). Returns the names copied."""
    names = []
    for path in paths:
        name = os.path.basename(path)
        # O_NOFOLLOW: find_extras resolved the path; a link put there since is refused
        with os.fdopen(os.open(path, os.O_RDONLY | os.O_NOFOLLOW), "rb") as src, \
                replacing(os.path.join(out_dir, name)) as tmp:
            mode = stat.S_IMODE(os.fstat(src.fileno()).st_mode)
            with open(tmp, "wb") as dst:
                shutil.copyfileobj(src, dst)
                dst.flush()
                os.fchmod(dst.fileno(), mode & os.stat(tmp).st_mode & 0o777)
                os.fsync(dst.fileno())
        names.append(name)
    return names
