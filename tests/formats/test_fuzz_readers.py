"""The fuzz targets of tests/helpers/fuzz_readers.py, 10,000 generated inputs in all: DeepSpeed
rank files and our manifests, mutated. Each target runs in a child process limited to
3 GiB of address space (RLIMIT_AS: an allocation beyond it fails the run with MemoryError
instead of exhausting the machine); it must raise nothing but the documented errors
(docs/untrusted-input.md) and peak under 512 MiB of RSS."""

import json
import os
import resource
import subprocess
import sys

import pytest

from helpers.paths import child_env, script

LIMIT = 3 << 30
MAX_RSS = 512 << 20
EXAMPLES = {"deepspeed": 7000, "manifest": 3000}


def _limit():
    resource.setrlimit(resource.RLIMIT_AS, (LIMIT, LIMIT))


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("target", sorted(EXAMPLES))
def test_fuzz_target(target):
    env = child_env(dict(os.environ, MALLOC_ARENA_MAX="2"))
    proc = subprocess.run([sys.executable, script("fuzz_readers.py"), target,
                           str(EXAMPLES[target])], capture_output=True, text=True,
                          preexec_fn=_limit, env=env, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["examples"] == EXAMPLES[target]
    assert result["peak_rss"] < MAX_RSS, result
