"""The side files consolidate carries next to the weights (config and tokenizer files) come
from a checkpoint that may be someone else's (issue 30, item 3): a symlink leading out of
the checkpoint folder is not followed, and a copy keeps its source's permissions, never
more."""

import os
import stat

from offload_engine.offline.hf_extras import copy_extras, find_extras


def checkpoint_with_side_files(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "latest").write_text("global_step2")
    (ckpt / "config.json").write_text('{"model_type": "llama"}')
    return ckpt


def test_a_symlink_out_of_the_checkpoint_is_not_carried(tmp_path):
    ckpt = checkpoint_with_side_files(tmp_path)
    secret = tmp_path / "home" / ".ssh" / "id_rsa"
    secret.parent.mkdir(parents=True)
    secret.write_text("-----BEGIN OPENSSH PRIVATE KEY-----")
    os.symlink(secret, ckpt / "tokenizer.json")
    os.symlink("../home/.ssh/id_rsa", ckpt / "vocab.json")  # relative links too
    found = find_extras(str(ckpt))
    assert [os.path.basename(p) for p in found] == ["config.json"]
    out = tmp_path / "out"
    out.mkdir()
    assert copy_extras(found, str(out)) == ["config.json"]
    assert sorted(os.listdir(out)) == ["config.json"]


def test_a_symlink_inside_the_checkpoint_is_carried_as_its_target(tmp_path):
    ckpt = checkpoint_with_side_files(tmp_path)
    (ckpt / "tok").mkdir()
    (ckpt / "tok" / "tokenizer.json").write_text('{"version": "1.0"}')
    os.symlink("tok/tokenizer.json", ckpt / "tokenizer.json")
    out = tmp_path / "out"
    out.mkdir()
    copy_extras(find_extras(str(ckpt)), str(out))
    assert (out / "tokenizer.json").read_text() == '{"version": "1.0"}'
    assert not os.path.islink(out / "tokenizer.json")


def test_a_private_file_stays_private(tmp_path):
    ckpt = checkpoint_with_side_files(tmp_path)
    os.chmod(ckpt / "config.json", 0o600)
    (ckpt / "tokenizer_config.json").write_text("{}")
    os.chmod(ckpt / "tokenizer_config.json", 0o644)
    out = tmp_path / "out"
    out.mkdir()
    copy_extras(find_extras(str(ckpt)), str(out))
    assert stat.S_IMODE(os.stat(out / "config.json").st_mode) == 0o600
    assert stat.S_IMODE(os.stat(out / "tokenizer_config.json").st_mode) & ~0o644 == 0
    assert (out / "config.json").read_text() == '{"model_type": "llama"}'
