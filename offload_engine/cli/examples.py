"""The "examples:" section at the end of every command's ``--help``: a few real command lines
a user can adapt, each under a one-line comment saying what it does.

Kept here, in one table, rather than in each subcommand's module: they are read together
(the same folder names across commands) and tests/cli/test_cli_manners.py parses every one
with the real parser, so an example cannot name an option that does not exist.
"""

from __future__ import annotations

import argparse

# command words -> (what it does, the command line); lines stay under 80 columns
EXAMPLES: dict[tuple, list[tuple[str, str]]] = {
    (): [
        ("the whole product, end to end, on this machine", "offload-engine demo --model tiny"),
        ("merge a checkpoint (ours or DeepSpeed's) into safetensors",
         "offload-engine consolidate ckpt/ hf_model/"),
        ("what a 70B model needs on 64 GPUs", "offload-engine plan --model config.json "
                                              "--world-size 64"),
    ],
    ("demo",): [
        ("the fastest run: a tiny model, no reference run",
         "offload-engine demo --model tiny --steps 20 --no-reference"),
        ("four processes, state on your NVMe drive, kept afterwards",
         "offload-engine demo --world-size 4 --store /mnt/nvme/demo --keep"),
    ],
    ("bench",): [
        ("find the best I/O settings for a drive and cache them",
         "offload-engine bench disk --path /mnt/nvme --quick"),
        ("the engine's throughput against fio, zarr and tensorstore",
         "offload-engine bench io --path /mnt/nvme --size 4GiB"),
    ],
    ("bench", "io"): [
        ("measure with the cached device profile's settings",
         "offload-engine bench io --path /mnt/nvme"),
        ("more bytes and runs, as JSON", "offload-engine bench io --path /mnt/nvme --size 8GiB "
                                         "--runs 5 --json"),
    ],
    ("bench", "disk"): [
        ("a one-minute sweep, best settings cached for plan and the store",
         "offload-engine bench disk --path /mnt/nvme --quick"),
        ("the full sweep, nothing saved", "offload-engine bench disk --path /mnt/nvme "
                                          "--no-cache --json"),
        ("the best point as a DeepSpeed aio block",
         "offload-engine bench disk --path /mnt/nvme --deepspeed-aio"),
    ],
    ("consolidate",): [
        ("our checkpoint (any world size) into model.safetensors",
         "offload-engine consolidate ckpt/ hf_model/"),
        ("a DeepSpeed run, in bf16, shards of at most 2 GB",
         "offload-engine consolidate ds_run/ hf_model/ --dtype bf16 --max-shard-size 2GB"),
        ("a given DeepSpeed tag, re-read and compared afterwards",
         "offload-engine consolidate ds_run/ hf_model/ --tag global_step1000 --verify"),
    ],
    ("plan",): [
        ("8 GPUs of 80 GB, nodes of 512 GB, 2 TB of NVMe each",
         "offload-engine plan --model config.json --world-size 8 --cpu-mem 512GB "
         "--nvme-capacity 2TB"),
        ("a 2-D mesh, and the store config to use",
         "offload-engine plan --model config.json --mesh dp_shard=8,tp=2 --world-size 16 "
         "--emit-config store.json"),
    ],
    ("inspect",): [
        ("list what a checkpoint holds (metadata only)", "offload-engine inspect ckpt/"),
        ("statistics of the first layer's states",
         "offload-engine inspect ckpt/ --stats --name 'layers.0.*'"),
        ("a safetensors file, as JSON", "offload-engine inspect hf_model/model.safetensors "
                                        "--json"),
    ],
    ("diff",): [
        ("two checkpoints, bit for bit", "offload-engine diff run_a/ckpt/ run_b/ckpt/"),
        ("every state, within a tolerance",
         "offload-engine diff ckpt/ ds_run/ --state all --rtol 1e-6"),
        ("names, shapes and dtypes only", "offload-engine diff hf_model/ ckpt/ "
                                          "--metadata-only"),
        ("a run's live store (every rank) against its checkpoint",
         "offload-engine diff /nvme0/run ckpt/"),
    ],
    ("export",): [
        ("a weight as numpy", "offload-engine export ckpt/ lm_head.weight --out lm_head.npy"),
        ("its Muon momentum as safetensors",
         "offload-engine export ckpt/ layers.0.mlp.weight --state momentum_buffer "
         "--out m.safetensors"),
        ("from a DeepSpeed tag, cast to bf16",
         "offload-engine export ds_run/ lm_head.weight --tag global_step1000 --dtype bf16 "
         "--out w.pt"),
    ],
    ("config",): [
        ("translate a DeepSpeed config", "offload-engine config from-deepspeed ds_config.json"),
    ],
    ("config", "from-deepspeed"): [
        ("see what maps and what does not", "offload-engine config from-deepspeed "
                                            "ds_config.json"),
        ("write the store config and ZeroMuon's arguments",
         "offload-engine config from-deepspeed ds_config.json --out store.json "
         "--optimizer-out zero_muon.json"),
    ],
    ("import",): [
        ("a DeepSpeed run, to resume on 8 ranks with ZeroMuon",
         "offload-engine import deepspeed ds_run/ ckpt/ --world-size 8"),
    ],
    ("import", "deepspeed"): [
        ("the latest tag, to resume on 8 ranks",
         "offload-engine import deepspeed ds_run/ ckpt/ --world-size 8"),
        ("a given tag, the parameters' dtype from config.json",
         "offload-engine import deepspeed ds_run/ ckpt/ --world-size 8 "
         "--tag global_step1000 --model-config config.json"),
    ],
    ("completion",): [
        ("bash: install for your user (open a new shell afterwards)",
         "offload-engine completion bash > "
         "~/.local/share/bash-completion/completions/offload-engine"),
        ("zsh: a folder on your $fpath", "offload-engine completion zsh > ~/.zfunc/"
                                         "_offload-engine"),
    ],
}

HEADING = "examples:"
WIDTH = 79  # the widest line an example takes in the help, continuation backslash included


class ExamplesHelpFormatter(argparse.HelpFormatter):
    """argparse's formatter, except that the examples section keeps its lines as written
    (the description and option help still wrap to the terminal)."""

    def _fill_text(self, text, width, indent):
        if text.startswith(HEADING):
            return text
        return super()._fill_text(text, width, indent)


def examples_text(words: tuple) -> str | None:
    """The epilog for command ``words``, or None where there is none."""
    rows = EXAMPLES.get(words)
    if not rows:
        return None
    lines = [HEADING]
    for what, command in rows:
        lines += [f"  # {what}", *_wrapped(command)]
    return "\n".join(lines)


def _wrapped(command: str) -> list[str]:
    """``command`` as shell lines of at most WIDTH columns, continued with a backslash; an
    option stays on the line of its value."""
    pieces = []
    for word in command.split(" "):
        if pieces and pieces[-1].startswith(("-", ">")) and " " not in pieces[-1] \
                and not word.startswith("-"):
            pieces[-1] += " " + word
        else:
            pieces.append(word)
    lines, line = [], "  "
    for piece in pieces:
        if line.strip() and len(line) + 1 + len(piece) + 2 > WIDTH:
            lines.append(line + " \\")
            line = "      " + piece
        else:
            line = line + (" " if line.strip() else "") + piece
    return lines + [line]


def add_examples(parser: argparse.ArgumentParser, words: tuple) -> None:
    """Give ``parser`` (the command ``words``) its examples section."""
    text = examples_text(words)
    if text is None:
        return
    parser.epilog = text
    parser.formatter_class = ExamplesHelpFormatter
