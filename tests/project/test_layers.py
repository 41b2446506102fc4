"""tools/check_layers.py: the package keeps its layer order and has no import cycle, and the
checker would say if not."""

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest

from helpers.paths import ROOT

TOOL = os.path.join(ROOT, "tools", "check_layers.py")


def load_tool():
    spec = importlib.util.spec_from_file_location("check_layers", TOOL)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def run_tool(*args):
    return subprocess.run([sys.executable, TOOL, *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)


def make_package(root, files):
    """A package `pkg` under root: {"io/a.py": source, ...}, every folder given an __init__."""
    pkg = root / "pkg"
    for rel, source in {"__init__.py": "", "units.py": "", **files}.items():
        path = pkg / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        folder = path.parent
        while folder != root:
            (folder / "__init__.py").touch()
            folder = folder.parent
        path.write_text(textwrap.dedent(source))
    return pkg


@pytest.mark.multiprocess
def test_the_package_keeps_its_layer_order():
    done = run_tool()
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout == ""


def test_the_checker_sees_the_packages_real_imports(monkeypatch):
    # With the order reversed, the real package's downward imports become upward ones: a
    # checker that parsed nothing (or the wrong folder) would pass both orders.
    tool = load_tool()
    monkeypatch.setattr(tool, "ORDER", list(reversed(tool.ORDER)))
    bad = tool.check(os.path.join(ROOT, "offload_engine"))
    assert any(line.startswith("offload_engine/store/") and "imports io" in line for line in bad)


@pytest.mark.multiprocess
def test_a_clean_package_passes(tmp_path):
    pkg = make_package(tmp_path, {
        "io/a.py": "import os\nfrom pkg.units import x\nfrom .. import units\nfrom . import b\n",
        "io/b.py": "from pkg import __version__\n",
        "cli/main.py": "from pkg.io import a\nimport pkg.io.b\nfrom ..io import b\n",
        "dtypes.py": "from . import units\n",
    })
    done = run_tool(str(pkg))
    assert (done.returncode, done.stdout) == (0, "")


@pytest.mark.parametrize("files, expected", [
    ({"io/a.py": "import os\nimport pkg.cli.main\n", "cli/main.py": ""},
     "pkg/io/a.py:2: io imports cli, a higher layer (pkg.cli.main)"),
    ({"io/a.py": "def f():\n    from pkg.cli import main\n    return main\n", "cli/main.py": ""},
     "pkg/io/a.py:2: io imports cli, a higher layer (pkg.cli)"),
    ({"io/sub/a.py": "from ...store import tiered\n", "store/tiered.py": ""},
     "pkg/io/sub/a.py:1: io imports store, a higher layer (pkg.store)"),
    ({"layout/__init__.py": "from .. import optim\n", "optim/__init__.py": ""},
     "pkg/layout/__init__.py:1: layout imports optim, a higher layer (pkg.optim)"),
    ({"units.py": "from .io import align\n", "io/align.py": ""},
     "pkg/units.py:1: base module units imports layer io (pkg.io)"),
    ({"__init__.py": "from . import cli\n", "cli/main.py": ""},
     "pkg/__init__.py:1: base module __init__ imports layer cli (pkg.cli)"),
    ({"newthing/a.py": "from pkg.cli import main\n", "cli/main.py": ""},
     "pkg/newthing: newthing is not in the layer order"),
    ({"helpers.py": ""}, "pkg/helpers.py: helpers is not in the layer order"),
], ids=["upward", "lazy-upward", "relative-upward", "relative-root-name", "base-imports-layer",
        "init-imports-layer", "unknown-package", "unknown-module"])
@pytest.mark.multiprocess
def test_a_violation_is_reported_with_file_and_line(tmp_path, files, expected):
    done = run_tool(str(make_package(tmp_path, files)))
    assert done.returncode == 1, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert any(line.startswith(expected) for line in lines), lines
    assert len(lines) == 2  # the violation and the summary: nothing else was flagged


def test_the_package_has_no_import_cycle():
    tool = load_tool()
    assert [line for line in tool.check(os.path.join(ROOT, "offload_engine"))
            if "import cycle" in line] == []


@pytest.mark.parametrize("files, members", [
    ({"io/a.py": "from . import b\n", "io/b.py": "def f():\n    from .a import g\n"},
     ["pkg.io.a", "pkg.io.b"]),
    ({"io/a.py": "import pkg.io.b\n", "io/b.py": "from pkg.io.c import x\n",
      "io/c.py": "from .a import y\n", "io/d.py": "from . import a\n"},
     ["pkg.io.a", "pkg.io.b", "pkg.io.c"]),
    ({"io/__init__.py": "from .a import x\n", "io/a.py": "from pkg.io import y\n"},
     ["pkg.io", "pkg.io.a"]),
], ids=["lazy-pair", "three", "through-init"])
def test_an_import_cycle_is_reported_once_with_its_modules(tmp_path, capsys, files, members):
    rc = load_tool().main([str(make_package(tmp_path, files))])
    out = capsys.readouterr().out
    assert rc == 1, out
    lines = out.splitlines()
    cycles = [line for line in lines if "import cycle of" in line]
    assert len(cycles) == 1 and len(lines) == 2, lines  # the cycle and the summary
    assert f"import cycle of {len(members)} modules: {', '.join(members)} (" in cycles[0]
    for m in members:  # each import that closes it, with its file and line
        assert f"imports {m}" in cycles[0]


@pytest.mark.multiprocess
def test_a_missing_folder_is_an_error_not_a_pass(tmp_path):
    done = run_tool(str(tmp_path / "absent"))
    assert done.returncode == 2
    assert "absent" in done.stderr
