"""One idea per file: no module of the package grows past 600 lines (issue 28). A module
that needs more holds more than one idea; split it where docs/architecture.md's "To change
X, edit Y" table would want two rows."""

import pathlib

import offload_engine

LIMIT = 600


def test_no_module_is_over_600_lines():
    root = pathlib.Path(offload_engine.__file__).parent
    sizes = {str(p.relative_to(root.parent)): len(p.read_text().splitlines())
             for p in root.rglob("*.py") if "__pycache__" not in p.parts}
    assert len(sizes) > 100  # the whole package was walked
    over = {name: n for name, n in sizes.items() if n > LIMIT}
    assert over == {}, f"over {LIMIT} lines: {over}"
