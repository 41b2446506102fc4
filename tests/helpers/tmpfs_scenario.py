"""The full-disk scenario of issue 14 on a real file system, run by
tests/io/test_full_disk.py inside a private mount namespace: ``python tmpfs_scenario.py DIR``
where DIR is a freshly mounted 20 MiB tmpfs.

1. A ZeroMuon optimizer with its store in DIR/state; the disk is filled; a step must fail
   with an error naming the file and ENOSPC. The disk is freed: the next step, flush and
   save (generation 1) work.
2. The disk is filled again; a step, then a save must fail naming the file and rank 0.
   The disk is freed: close returns, no byte the store held is lost, generation 1 loads
   bit-exact and ``latest`` still names it.

Exits non-zero with the reason on any broken promise; prints "tmpfs scenario: ok".
"""

from __future__ import annotations

import errno
import os
import sys

import torch

from helpers import fault_scenarios as fs


def fill(directory: str) -> str:
    """Write a file until the file system is full; returns its path."""
    path = os.path.join(directory, "filler")
    block = b"\xff" * 65536
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        while True:
            try:
                os.write(fd, block)
            except OSError as e:
                if e.errno != errno.ENOSPC:
                    raise
                if len(block) == 1:
                    return path
                block = block[:len(block) // 2]  # the last pages too
    finally:
        os.close(fd)


def expect_full_disk(fn, where: str, *names: str) -> BaseException:
    try:
        fn()
    except OSError as e:
        text = str(e)
        assert e.errno == errno.ENOSPC, f"{where}: errno {e.errno}: {text}"
        for name in names:
            assert name in text, f"{where}: the error does not name {name!r}: {text}"
        print(f"{where}: {type(e).__name__}: {text}")
        return e
    raise AssertionError(f"{where}: no error on a full disk")


def main(root: str) -> None:
    from offload_engine.checkpoint import load_checkpoint, save_checkpoint
    from offload_engine.io import AsyncFileIO
    from offload_engine.layout import FlatArray
    ck = os.path.join(root, "ck")
    model, opt = fs.make_optimizer(os.path.join(root, "state"))
    store_root = opt.store.root

    filler = fill(root)                               # 1: full before the first write-back
    fs.set_grads(model, 0)
    expect_full_disk(opt.step, "step on a full disk", store_root)
    os.unlink(filler)
    for k in (1, 2):
        fs.set_grads(model, k)
        opt.step()
    opt.store.flush()
    save_checkpoint(ck, model, opt, 1)
    gen1 = fs.capture(model, opt)

    filler = fill(root)                               # 2: full again, chunk files exist
    fs.set_grads(model, 3)
    try:
        opt.step()  # may work: the store's chunk files are allocated already
    except OSError as e:
        print(f"second step on a full disk: {e}")
    expect_full_disk(lambda: save_checkpoint(ck, model, opt, 4), "save on a full disk",
                     "rank 0", ck)
    os.unlink(filler)
    held = [b.key for b in opt.store._resident if b.refs > b.keeps]
    assert not held, f"buckets still lent: {held}"
    want = fs.store_bytes(opt.store)
    opt.close()
    with AsyncFileIO(threads=1, queue_depth=1) as io:
        for name, t in want.items():
            got = FlatArray.open(os.path.join(store_root, name), io=io).read()
            assert torch.equal(got, t), f"store array {name} lost bytes"
    with open(os.path.join(ck, "latest")) as f:
        assert f.read().strip() == "step-00000001"
    m2, o2 = fs.make_optimizer(os.path.join(root, "load"), seed=77)
    assert load_checkpoint(ck, m2, o2) == 1
    fs.assert_same(m2, o2, gen1, "generation 1")
    o2.close()
    print("tmpfs scenario: ok")


if __name__ == "__main__":
    main(sys.argv[1])
