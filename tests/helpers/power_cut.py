"""Replay a recorded sequence of file-system calls (tests/helpers/fs_trace.py) under the
pessimistic model of a power cut, and check a checkpoint folder after each call.

The model: a file's data survives a power cut only as it was at its last fsync (or
fdatasync); a directory's entries (a create, mkdir, rename or unlink in it) only as they
were at the last fsync of that directory. sync_file_range ("write_out") makes nothing
durable. The durable view (what a restart finds) follows the root's durable entries down,
each file with its durable data; the root itself is taken as durable.

After each call (a power cut there), ``check`` asks:

1. ``latest`` names only durable generations: every name ``latest`` could be read as after
   the cut (its durable entry or its live one, each with its durable or its live bytes:
   whatever the file system happened to write early) is a generation that is whole: its
   entry, every directory's entries and every file's data are those of its commit, both
   as durable and as they are now (which may reach the disk early); none is unreadable.
2. a restart finds every committed generation: the durable ``latest`` names the newest
   generation a save reported committed to its caller (a ``mark`` of the test) or one
   committed after it, and each reported generation not since removed on purpose is whole.
3. no generation is torn under its own name: whichever folder holds a generation's name
   (durable or live) is a whole commit of it (a removal by ``keep_last`` must not tear a
   generation that is still there after the cut).

``replay(lines, ckpt, drop=...)`` leaves out the sync calls ``drop`` selects, and
``idle_syncs`` finds the fsync sites no power cut needs.
"""

from __future__ import annotations

import os
import re
from itertools import count

from offload_engine.layout.checkpoint_names import (LATEST, is_being_deleted, is_set_aside,
                                                    is_torn)

_ids = count()


class Node:
    """A file (data versions) or a directory (entries), live and durable."""

    def __init__(self, kind: str):
        self.kind = kind                      # "file", "dir" or "link"
        self.id = next(_ids)
        self.version = self.durable_version = 0
        self.data: bytes | None = b""         # None: not known (big or positional writes)
        self.durable_data: bytes | None = b""
        self.entries: dict[str, Node] = {}
        self.durable: dict[str, Node] = {}

    def __repr__(self) -> str:
        return f"<{self.kind} {self.id}>"


class PowerCutModel:
    def __init__(self, ckpt: str):
        self.ckpt = ckpt                      # the checkpoint folder, relative to the root
        self.root = Node("dir")
        self.by_ino: dict[int, Node] = {}
        self.committed: list[str] = []        # generations reported committed, in order
        self.commit_order: list[str] = []     # generations as their commit renames happened
        self.final: dict[str, tuple] = {}     # name -> (folder, tree) of its newest commit
        self.commits: dict[int, tuple] = {}   # folder id -> (folder, tree) of every commit
        self.violations: list[str] = []
        self.synced: list[int] = []           # the node of each sync applied, in order

    # -- paths ----------------------------------------------------------------------------------
    def _walk(self, rel: str, durable: bool = False) -> Node | None:
        node = self.root
        for part in [p for p in rel.split("/") if p]:
            entries = node.durable if durable else node.entries
            node = entries.get(part) if node.kind == "dir" else None
            if node is None:
                return None
        return node

    def _parent(self, rel: str) -> tuple[Node, str]:
        head, name = os.path.split(rel)
        parent = self._walk(head)
        if parent is None or parent.kind != "dir":
            raise AssertionError(f"replay: no directory {head!r} for {rel!r}")
        return parent, name

    def _ino(self, line: dict) -> Node:
        node = self.by_ino.get(line["ino"])
        if node is None and line.get("path") == "":
            node = self.root  # the traced root, there before the run
        if node is None:
            raise AssertionError(f"replay: {line['op']} on a file never created under the "
                                 f"root: {line.get('path')} (site {line.get('site')})")
        return node

    # -- the calls ------------------------------------------------------------------------------
    def apply(self, line: dict) -> None:
        op = line["op"]
        if op in ("create", "mkdir"):
            parent, name = self._parent(line["path"])
            node = Node("dir" if op == "mkdir" else "link" if line.get("link") else "file")
            parent.entries[name] = node
            self.by_ino[line["ino"]] = node   # an inode number reused names the new file
        elif op == "write":
            node = self._ino(line)
            node.version += 1
            data = line.get("data")
            node.data = None if data is None or node.data is None else \
                node.data + data.encode("latin-1")
        elif op == "sync":
            node = self._ino(line)
            self.synced.append(node.id)
            if node.kind == "dir":
                node.durable = dict(node.entries)
            else:
                node.durable_version, node.durable_data = node.version, node.data
        elif op == "rename":
            parent, name = self._parent(line["path"])
            node = parent.entries.pop(name)
            to, to_name = self._parent(line["dst"])
            to.entries[to_name] = node
            if os.path.dirname(line["dst"]) == self.ckpt and _is_generation(to_name):
                self.commit_order.append(to_name)   # the commit: the tree is final now
                self.final[to_name] = (node, _tree(node, durable=False))
                self.commits[node.id] = self.final[to_name]
        elif op in ("unlink", "rmtree"):
            parent, name = self._parent(line["path"])
            node = parent.entries.pop(name, None)
            if node is None:
                raise AssertionError(f"replay: {op} of {line['path']!r}, which is not there")
            stack = [node]
            while stack:  # rmtree unlinks every entry below: each may reach the disk early
                d = stack.pop()
                stack.extend(c for c in d.entries.values() if c.kind == "dir")
                d.entries = {}
        elif op == "mark":
            if line["what"] == "committed":
                self.committed.append(line["generation"])
        elif op != "write_out":
            raise AssertionError(f"replay: unknown op {op}")

    # -- the checks -------------------------------------------------------------------------------
    def check(self, where: str) -> None:
        """Record what a power cut right now would break (``self.violations``)."""
        ckpt_live, ckpt_durable = self._walk(self.ckpt), self._walk(self.ckpt, durable=True)
        live = ckpt_live.entries if ckpt_live else {}
        durable = ckpt_durable.durable if ckpt_durable else {}
        # 1. every name latest could be read as, whatever reached the disk early
        for node in {n for n in (live.get(LATEST), durable.get(LATEST)) if n}:
            for data in {node.durable_data, node.data}:
                name = _latest_name(data)
                problem = "not a generation name (a torn latest)" if name is None else \
                    self._generation_problem(name, live, durable)
                if problem:
                    self._violation(f"{where}: latest could read {data!r}: {problem}")
        # 2. a restart's latest names the newest generation reported committed, or a later one
        if self.committed:
            newest = self.committed[-1]
            restart = durable.get(LATEST)
            name = _latest_name(restart.durable_data) if restart else None
            if name not in self.commit_order or \
                    self.commit_order.index(name) < self.commit_order.index(newest):
                self._violation(f"{where}: {newest} was reported committed, but a restart "
                                f"finds latest = {name!r}")
        # 3. every generation under its name (and every committed one still there) is whole
        #    (one that is only live, or only durable, may be there after the cut or not)
        required = {n for n in self.committed if n in live}
        names = {n for n in set(live) | set(durable) if _is_generation(n)} | required
        for name in sorted(names):
            problem = self._generation_problem(name, live, durable, name in required)
            if problem:
                self._violation(f"{where}: {problem}")

    def _generation_problem(self, gen: str, live: dict, durable: dict,
                            required: bool = True) -> str | None:
        """Why generation ``gen`` could be missing (when ``required``) or torn after a power
        cut now. Every directory's entries and every file's data must be the committed ones
        both as they are durable and as they are now (which may reach the disk early), so
        no mix of the two tears it; so must its entry in the checkpoint folder when
        ``required``, as its newest commit (else whichever folder holds the name must be a
        whole commit of it: an orphan being set aside is one)."""
        if gen not in self.final:
            return f"{gen} was never committed"
        if not required:
            for node in {n for n in (durable.get(gen), live.get(gen)) if n is not None}:
                if node.id not in self.commits:
                    return f"{gen}: a folder never committed holds the name"
                problem = self._torn(gen, *self.commits[node.id])
                if problem:
                    return problem
            return None
        top, tree = self.final[gen]
        if durable.get(gen) is not top:
            return f"{gen} is not durable in the checkpoint folder"
        if live.get(gen) is not top:
            return f"{gen} is no longer in the checkpoint folder (that may reach the disk)"
        return self._torn(gen, top, tree)

    def _torn(self, gen: str, top: Node, tree: dict) -> str | None:
        """Why committed folder ``top`` (``tree`` as committed) could be torn now."""
        dirs = {"": top} | {p: n for p, (n, _) in tree.items() if n.kind == "dir"}
        want: dict[str, dict] = {p: {} for p in dirs}
        for path, (node, version) in tree.items():
            head, name = path.rpartition("/")[0], path.rpartition("/")[2]
            want[head][name] = node
            if node.kind != "dir" and not node.durable_version == node.version == version:
                return f"{gen}/{path}: its data is not durable as committed"
        for path, node in dirs.items():
            for view, entries in (("durable", node.durable), ("live", node.entries)):
                if entries.keys() != want[path].keys() or any(
                        entries[k] is not v for k, v in want[path].items()):
                    diff = sorted(set(want[path]) ^ set(entries))[:3]
                    return (f"{gen}/{path}: its {view} entries are not the committed ones "
                            f"({diff or 'other files under the same names'})")
        return None

    def _violation(self, text: str) -> None:
        if len(self.violations) < 20:
            self.violations.append(text)
        elif len(self.violations) == 20:
            self.violations.append("...")


def _is_generation(name: str) -> bool:
    """A committed generation's name (a step or a tag): not latest, a dot-file (the writer
    lock), a torn, set-aside or half-removed one."""
    return bool(name) and not name.startswith(".") and name != LATEST and not (
        is_torn(name) or is_being_deleted(name) or is_set_aside(name))


def _latest_name(data) -> str | None:
    if not data:
        return None
    try:
        name = data.decode().strip()
    except UnicodeDecodeError:
        return None
    return name if _is_generation(name) else None


def _tree(node: Node | None, durable: bool) -> dict | None:
    """``{relative path: (node, data version)}`` below directory ``node``."""
    if node is None or node.kind != "dir":
        return None
    out = {}
    stack = [("", node)]
    while stack:
        prefix, d = stack.pop()
        for name, child in (d.durable if durable else d.entries).items():
            path = prefix + name
            out[path] = (child, child.durable_version if durable else child.version)
            if child.kind == "dir":
                stack.append((path + "/", child))
    return out


def replay(lines: list[dict], ckpt: str, drop=None, check: bool = True) -> PowerCutModel:
    """Replay ``lines`` (leaving out the sync lines for which ``drop(line)`` is true),
    checking after each (unless not ``check``); the model, with its ``violations``."""
    model = PowerCutModel(ckpt)
    if check:
        model.check("before the first call")
    for i, line in enumerate(lines):
        if drop is not None and line["op"] == "sync" and drop(line):
            continue
        model.apply(line)
        if check:
            model.check(f"after call {i} ({line['op']} {line.get('path', '')} by "
                        f"{(line.get('site') or ['?'])[0]})")
    return model


# -- the fsync sites of a run ---------------------------------------------------------------
def path_role(rel: str) -> str:
    """A recorded path with what changes from save to save replaced: generation names,
    ranks, chunk numbers, temporary suffixes."""
    rel = re.sub(r"step-\d+", "<gen>", rel)
    rel = re.sub(r"rank\d+", "rank{r}", rel)
    rel = re.sub(r"/c/\d+$", "/c/<i>", rel)
    rel = re.sub(r"\.[0-9a-f]{32}\.tmp$", ".<tmp>", rel)
    return rel


def sync_site(line: dict) -> str:
    """Which fsync this is: the engine function that made it, the first function above
    layout/ and io/ that asked for it (say ``checkpoint.checkpoint_dir.commit``) and the
    role of its path."""
    frames = line.get("site") or ["?"]
    asked = next((f for f in frames if not f.startswith(("layout.", "io."))), "?")
    return f"{frames[0]} for {asked}: {path_role(line['path'])}"


def sync_sites(lines: list[dict]) -> dict[str, set[int]]:
    """``{site: the files and folders (model node ids) its calls synced}`` of a run."""
    synced = iter(replay(lines, "", check=False).synced)
    out: dict[str, set[int]] = {}
    for line in lines:
        if line["op"] == "sync":
            out.setdefault(sync_site(line), set()).add(next(synced))
    return out


def idle_syncs(lines: list[dict], ckpt: str) -> list[str]:
    """The sync sites of a run that no power cut needs: leaving out every call of the site
    breaks nothing, nor does leaving it out together with any other such site that synced
    the same file or folder (a file fsynced at two sites, by its writer and again before
    the commit, needs one of them: leaving out both is a violation)."""
    sites = sync_sites(lines)
    alone = [site for site in sites
             if not replay(lines, ckpt, drop=lambda line: sync_site(line) == site).violations]
    idle = []
    for site in alone:
        twins = [t for t in alone if t != site and sites[t] & sites[site]]
        if not any(replay(lines, ckpt, drop=lambda line: sync_site(line) in (site, t)).violations
                   for t in twins):
            idle.append(site)
    return idle


def live_names(model: PowerCutModel) -> set[str]:
    """Every path below the root in the model's live tree (to compare with the disk)."""
    return set(_tree(model.root, durable=False))
