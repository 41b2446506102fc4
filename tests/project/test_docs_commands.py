"""Every command in README.md and docs/*.md runs as written, and prints what the doc shows.

The commands are those of ``helpers.docs_commands`` (shell blocks whole; ``$ `` lines of
transcripts, with the output shown under them and the exit code of a following
``$ echo $?``). Each doc's commands run in order, in a fresh folder of their own that holds
links to the repository's top-level entries (``tests/fixtures/...``, ``tools/``,
``examples/`` resolve as from a clone) and ``offload-engine``, ``python`` and ``torchrun``
first on PATH. The doc's ``/tmp/...`` paths (and ``/nvme/``, ``/work/bench``) move under that
folder, and the doc's ``/work/main`` in shown output stands for the repository. A shown line
must appear in the real output (``...`` elides); for a measurement (``MEASURED``) only its
skeleton, numbers aside, must. Python blocks run too where they are whole programs: here
(``PYTHON_SNIPPETS``, with the few names they assume) or in tests/project/test_docs.py.

A command or Python block that cannot run here is in ``CANNOT_RUN``, the one table, with the
reason. Anything else runs: a new command in the docs runs in the suite from the day it is
written, and fails it if it cannot.
"""

from __future__ import annotations

import os
import re
import stat
import subprocess
import sys

import pytest

from helpers.docs_commands import (DOC_TMP, all_commands, blocks, localize,
                                   missing_lines, python_blocks)
from helpers.paths import ROOT, child_env

# (doc, regex searched in the command or Python block, why it does not run here). One row
# may cover several commands of one doc; a row that matches nothing fails the suite.
CANNOT_RUN = [
    ("README.md", r"^\./quickstart\.sh demo",
     "sets up .venv, then runs the demo (3 minutes of training; tests/integration/test_demo.py "
     "runs it) or the whole suite (this one: CI's .ci/run is ./quickstart.sh test)"),
    ("docs/benchmarks.md", r"^python tools/bench_all\.py --quick --path /nvme/bench",
     "every benchmark, minutes (--quick) to hours (--full, ~150 GB of disk); "
     "tests/tools/test_tools_smoke.py runs tools/bench_all.py --tiny --only io,startup"),
    ("docs/benchmarks.md", r"^python tools/bench_all\.py --full --resume",
     "carries on the --full run in results/bench_all-full (hours: the 1 B Muon step and the "
     "3.4 B Muon training beside DeepSpeed); tests/tools/test_tools_smoke.py runs --resume on "
     "--tiny"),
    ("docs/benchmarks.md", r"^python tools/bench_step\.py --path /nvme/bench --world 2 --dim 768",
     "steps of a 134 M and a 1 B model against DeepSpeed (installed apart, see "
     "--deepspeed-python); tests/tools/test_tools_smoke.py runs bench_step small"),
    ("docs/benchmarks.md", r"^python tools/bench_train_large\.py --path /nvme/bench --params 3e9",
     "a 3 B model with 36 GB of state on NVMe, and DeepSpeed; tests/tools/test_tools_smoke.py "
     "runs it at a tiny size"),
    ("docs/checkpoint.md", r"tools/bench_checkpoint\.py",
     "a benchmark (minutes of timed I/O); tests/tools/test_tools_smoke.py runs it small"),
    ("docs/consolidate.md", r"pip install torch==2\.13\.0 deepspeed",
     "installs DeepSpeed into a new venv (network), then a benchmark against it"),
    ("docs/multi-node.md", r"torchrun --nnodes=N",
     "several nodes (HOST:PORT, N nodes of G GPUs); tests/integration/test_multi_node.py "
     "runs two simulated nodes"),
    ("docs/optimizer.md", r"tools/bench_step\.py --path /work/bench_tmp",
     "a benchmark (timed steps); tests/tools/test_tools_smoke.py runs it small"),
    ("docs/optimizer.md", r"pip install deepspeed==",
     "installs DeepSpeed (network, libaio, minutes building its ops)"),
    ("docs/optimizer.md", r"accelerate launch --config_file fsdp2\.yaml",
     "train.py and fsdp2.yaml are the doc's blocks, on 2 processes with a tiny-gpt2 folder; "
     "tests/integration/test_accelerate_fsdp2.py launches them and consolidates"),
    ("docs/plan.md", r"^offload-engine bench disk --path /tmp/pl/bs",
     "a disk benchmark: 20 points x 2 runs over a 256 MiB file, over 10 GiB of timed I/O; "
     "tests/cli/test_bench_disk.py runs bench disk --quick"),
    # Python blocks
    ("docs/consolidate.md", r"get_fp32_state_dict_from_zero_checkpoint\(\"checkpoints/\"",
     "two lines of a user's script; tests/integration/test_zero_to_fp32_dropin.py runs "
     "a whole script written against zero_to_fp32 with only its import changed"),
    ("docs/consolidate.md", r"PerExpertSource\(src, family=\"qwen2_moe\", experts=128\)",
     "needs a checkpoint with 128-expert stacks; tests/offline/test_consolidate_moe.py "
     "runs PerExpertSource"),
    ("docs/migrate.md", r"deepspeed\.initialize",
     "a before/after fragment: DeepSpeed's side needs deepspeed, both a model and a batch"),
    ("docs/migrate.md", r"clip_grad_norm_\(model\.parameters",
     "a fragment of a training loop (model, opt)"),
    ("docs/migrate.md", r"load_state_dict_from_checkpoint\(model, \"ds_checkpoints/\"\)",
     "a fragment (the user's model and run); tests/offline/test_consolidate_api.py runs "
     "load_state_dict_from_checkpoint"),
    ("docs/multi-node.md", r"init_device_mesh\(\"cuda\", \(nodes, per_node\)",
     "a sketch for several nodes of GPUs (nccl); tests/helpers/multinode_train.py is its "
     "CPU form"),
    ("docs/optimizer.md", r"Train a small language model with FSDP2 and ZeroMuon",
     "examples/train_fsdp2.py verbatim (tests/integration/test_examples.py checks that); "
     "its torchrun command above runs here"),
    ("docs/optimizer.md", r"HSDP: replicate across nodes",
     "a sketch for 4 processes (build_model); tests/helpers/zero_muon_meshes.py builds "
     "these meshes for the tests"),
    ("docs/optimizer.md", r"^# train\.py\n",
     "accelerate launch's train.py (2 processes, a tiny-gpt2 folder); "
     "tests/integration/test_accelerate_fsdp2.py runs it"),
    ("docs/torchtitan.md", r"config = llama3_debugmodel\(\)",
     "a fragment of torchtitan's config; tests/integration/test_torchtitan.py builds it"),
]

# What a doc's commands assume exists before its first one, made in its folder.
PREPARE = {
    "docs/checkpoint.md": "cp -r tests/fixtures/deepspeed_import/zero3_w2_fp32_muon ds_ckpt",
    "docs/migrate.md": "cp tests/fixtures/deepspeed_configs/zero3_nvme_muon.json ds_config.json",
}

# (command regex, regex of its shown lines compared without their fractional numbers, why):
# figures that change from run to run or machine to machine; the lines' words and integer
# counts (bytes, steps) must not.
LOOSE = [
    (r"^torchrun .*examples/train_fsdp2\.py", "",
     "the losses: float sums over 2 processes, which differ with the CPU's kernels"),
    (r"^offload-engine inspect /tmp/oe-example/store ", r"^(files  |  zarr\.json )",
     "the store's manifest records its absolute path: its size depends on the folder"),
]

# Python blocks run here, by doc and a regex of the block, with the names they assume: an fp32
# array for the reader by hand, a bfloat16 one for zarr-python and tensorstore.
EXAMPLE_ARRAYS = "oe/ckpt/step-00000007/rank0/"
PYTHON_SNIPPETS = {
    ("docs/format.md", r"meta = json\.load\(open\(os\.path\.join\(A"):
        f"A = {EXAMPLE_ARRAYS + 'master'!r}\n",
    ("docs/format.md", r"zarr\.open_array\(A"): f"A = {EXAMPLE_ARRAYS + 'param_bfloat16'!r}\n",
    ("docs/consolidate.md", r"consolidate\(src, \"hf_out/\", max_shard_bytes"): "",
}
# made before the snippets run: the array the format snippets read, the "ckpt/" they consolidate
SNIPPET_SETUP = ("python -c \"import sys; sys.path.insert(0, 'tests')\n"
                 "from helpers.docs_examples import make_cli_examples; make_cli_examples('oe')\"\n"
                 "cp -r tests/fixtures/deepspeed/zero2_w3_fp32 ckpt")
RUN_BY_TEST_DOCS = ("docs/store.md", "docs/optimizer.md", "docs/checkpoint.md")
DOC_DIRS = ("/nvme/", "/work/bench")


def listed(doc: str, text: str) -> list:
    return [row for row in CANNOT_RUN if row[0] == doc and re.search(row[1], text, re.M)]


def snippet_prelude(block) -> str | None:
    for (doc, pattern), prelude in PYTHON_SNIPPETS.items():
        if doc == block.doc and re.search(pattern, block.text):
            return prelude
    return None


def runnable(doc: str) -> list:
    return [c for c in all_commands() if c.doc == doc and not listed(doc, c.text)]


# --- the accounting: nothing drifts silently -----------------------------------------------

def test_the_docs_have_commands_and_each_table_row_matches_one():
    commands = all_commands()
    assert len(commands) > 30
    texts = [(c.doc, c.text) for c in commands] + [(b.doc, b.text) for b in python_blocks()]
    stale = [row for row in CANNOT_RUN
             if not any(doc == row[0] and re.search(row[1], t, re.M) for doc, t in texts)]
    assert not stale, f"rows of CANNOT_RUN that match no command or Python block: {stale}"
    for pattern, _, _ in LOOSE:
        assert any(re.search(pattern, c.text) for c in commands), f"LOOSE: {pattern} is stale"
    for (doc, pattern), _ in PYTHON_SNIPPETS.items():
        assert any(b.doc == doc and re.search(pattern, b.text) for b in python_blocks()), pattern


def test_every_python_block_is_run_or_listed():
    unaccounted = []
    for b in python_blocks():
        if listed(b.doc, b.text) or snippet_prelude(b) is not None:
            continue
        if b.doc in RUN_BY_TEST_DOCS and "init_process_group" not in b.text:
            continue  # tests/project/test_docs.py runs these
        unaccounted.append(f"{b.doc}:{b.line}")
    assert not unaccounted, ("Python blocks neither run (test_docs.py, PYTHON_SNIPPETS) nor "
                             "listed in CANNOT_RUN with a reason: " + ", ".join(unaccounted))


def test_synopses_are_not_run_as_commands():
    """A synopsis (options in brackets) is not a command: in a ```bash block or after `$ `
    it would be run, and fail."""
    for c in all_commands():
        assert not re.search(r"\[--[a-z-]+", c.text.splitlines()[0]), (
            f"{c.where}: a synopsis in a command block; put it in a ```text block")


# --- running them ---------------------------------------------------------------------------

def workspace(base) -> str:
    """A folder that looks like the repository's root, with our commands first on PATH."""
    work = str(base)
    for name in os.listdir(ROOT):
        if name not in (".git", "tmp") and not name.startswith(".pytest"):
            os.symlink(os.path.join(ROOT, name), os.path.join(work, name))
    os.makedirs(os.path.join(work, "tmp"))
    bin_dir = os.path.join(work, ".docs-bin")
    os.makedirs(bin_dir)
    for name, args in {"offload-engine": "-m offload_engine.cli.main",
                       "torchrun": "-m torch.distributed.run", "python": "", "python3": ""}.items():
        path = os.path.join(bin_dir, name)
        with open(path, "w") as f:
            f.write(f'#!/bin/sh\nexec "{sys.executable}" {args} "$@"\n')
        os.chmod(path, os.stat(path).st_mode | stat.S_IXUSR)
    return work


def run_shell(script: str, work: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = child_env()
    env.update(PATH=os.path.join(work, ".docs-bin") + os.pathsep + env["PATH"], COLUMNS="80",
               NO_COLOR="1", XDG_CACHE_HOME=os.path.join(work, "cache"), PWD=work)
    script = localize(script, work)
    for d in DOC_DIRS:
        script = script.replace(d, os.path.join(work, d.strip("/").replace("/", "_")) + "/")
    return subprocess.run(["bash", "-c", script], cwd=work, env=env,
                          capture_output=True, text=True, timeout=timeout)


def run_doc(doc: str, work: str) -> list[str]:
    """Run the doc's commands in order; what went wrong, one entry per command."""
    failures = []
    if doc in PREPARE:
        done = run_shell(PREPARE[doc], work)
        assert done.returncode == 0, done.stderr
    for c in runnable(doc):
        done = run_shell(c.text, work)
        out = done.stdout + done.stderr
        if done.returncode != c.exit_code:
            failures.append(f"{c.where}: `{c.text[:120]}` exited {done.returncode}, the doc "
                            f"says {c.exit_code}:\n{out[-2000:]}")
            continue
        loose = next((lines for cmd, lines, _ in LOOSE if re.search(cmd, c.text)), None)
        missing = missing_lines(c.shown, out, work, loose)
        if missing:
            failures.append(f"{c.where}: `{c.text[:120]}` did not print these lines the doc "
                            "shows:\n  " + "\n  ".join(missing) + f"\nit printed:\n{out[-3000:]}")
    return failures


DOCS_WITH_COMMANDS = sorted({c.doc for c in all_commands() if not listed(c.doc, c.text)})


@pytest.mark.multiprocess
@pytest.mark.parametrize("doc", DOCS_WITH_COMMANDS)
def test_doc_commands_run_and_print_what_the_doc_shows(doc, tmp_path):
    failures = run_doc(doc, workspace(tmp_path))
    assert not failures, f"{len(failures)} command(s) of {doc}:\n\n" + "\n\n".join(failures)


@pytest.mark.multiprocess
def test_python_snippets_run(tmp_path):
    work = workspace(tmp_path)
    done = run_shell(SNIPPET_SETUP, work)
    assert done.returncode == 0, done.stderr
    failures = []
    for b in python_blocks():
        prelude = snippet_prelude(b)
        if prelude is None:
            continue
        done = run_shell(f"python - <<'DOCS_SNIPPET'\n{prelude}{b.text}DOCS_SNIPPET", work)
        if done.returncode != 0:
            failures.append(f"{b.doc}:{b.line}:\n{done.stderr[-2000:]}")
    assert not failures, "\n\n".join(failures)


@pytest.mark.multiprocess
def test_the_trainer_recipe_runs_without_transformers_token_warnings(tmp_path):
    """docs/optimizer.md's Hugging Face Trainer recipe: GPT-2's bos/eos id 50256 lies
    outside the recipe's 64-token vocabulary, which transformers warns about."""
    (recipe,) = [b for b in python_blocks()
                 if b.doc == "docs/optimizer.md" and "TrainerZeroMuon(args" in b.text]
    done = run_shell(f"python - <<'DOCS_SNIPPET'\n{recipe.text}DOCS_SNIPPET",
                     workspace(tmp_path))
    assert done.returncode == 0, done.stderr
    assert "[False, True]" in done.stdout
    for token in ("bos_token_id", "eos_token_id", "pad_token_id"):
        assert token not in done.stderr, done.stderr


def test_doc_paths_move_under_the_work_folder():
    assert localize("x /tmp/oe-example/ckpt", "/w") == "x /w/tmp/oe-example/ckpt"
    assert DOC_TMP == "/tmp/"
    assert [b.lang for b in blocks("README.md")][:1] == ["bash"]


def test_the_consolidate_doc_shows_the_side_files_it_copies():
    """docs/consolidate.md once said consolidate writes weights only (copy config.json
    yourself), while it copies the side files by default: a transcript shows the copy (run
    above), and the claim is gone."""
    commands = [c for c in all_commands() if c.doc == "docs/consolidate.md"]
    assert any(c.text.startswith("offload-engine consolidate ")
               and any(line.endswith("copied config.json") for line in c.shown)
               for c in commands)
    assert any(c.text.startswith("ls ") and "config.json" in c.shown for c in commands)
    with open(os.path.join(ROOT, "docs", "consolidate.md")) as f:
        assert "writes weights only" not in f.read()
