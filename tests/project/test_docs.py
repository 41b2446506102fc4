"""The Python examples in docs/ run as written."""

import os
import re

import pytest

from helpers.paths import ROOT

DOCS = os.path.join(ROOT, "docs")


def python_blocks(name):
    with open(os.path.join(DOCS, name)) as f:
        return re.findall(r"```python\n(.*?)```", f.read(), re.S)


@pytest.mark.parametrize("doc", ["store.md", "optimizer.md", "checkpoint.md"])
def test_python_examples_run(doc, capsys):
    blocks = python_blocks(doc)
    assert blocks, f"{doc} has no python example"
    for code in blocks:
        if "init_process_group" in code:
            continue  # a torchrun snippet: the multi-rank path is tested in test_zero_muon_*
        exec(compile(code, doc, "exec"), {})
    out = capsys.readouterr().out
    if doc == "store.md":
        assert "step 1: read 393216 B, wrote 393216 B" in out
        assert "[2.71 2.71 2.71 2.71]" in out
    if doc == "checkpoint.md":
        assert "3 True" in out.splitlines()               # the resumed run is bit for bit
        lines = out.splitlines()                          # tags, keep_last, weights only
        assert lines[1:4] == ["['best', 'latest', 'step-00000003', 'step-00000004']", "4", "True"]
        assert out.strip().splitlines()[-2:] == [
            "step-00000003 ['bytes', 'call_s', 'inline_copies', 'params_s', 'seconds', "
            "'state_buckets', 'step_waited_s', 'written_s']", "True"]
