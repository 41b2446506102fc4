"""The rules of tests/ (README, "Development"): every test file is in a folder of tests/, no test
module imports another (shared code is in tests/helpers/), and test folders are not packages, so
their file names are unique across tests/."""

import ast
import collections
import os

from helpers.paths import TESTS


def python_files():
    for folder, dirs, files in os.walk(TESTS):
        dirs[:] = [d for d in dirs if d not in ("fixtures", "__pycache__")]
        for name in files:
            if name.endswith(".py"):
                yield os.path.join(folder, name)


def imported_modules(path):
    for node in ast.walk(ast.parse(open(path).read(), path)):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module


def test_no_test_module_imports_another():
    bad = [f"{os.path.relpath(path, TESTS)} imports {module}"
           for path in python_files() for module in imported_modules(path)
           if module.split(".")[-1].startswith("test_")]
    assert not bad, "move what is shared into tests/helpers/:\n" + "\n".join(bad)


def test_every_test_file_is_in_a_folder_and_its_name_is_unique():
    names = collections.defaultdict(list)
    for path in python_files():
        rel = os.path.relpath(path, TESTS)
        if os.path.basename(rel).startswith("test_"):
            names[os.path.basename(rel)].append(rel)
    assert names, TESTS
    assert not [n for n, paths in names.items() if any(os.sep not in p for p in paths)]
    assert not {n: p for n, p in names.items() if len(p) > 1}


def test_only_helpers_is_a_package():
    packages = sorted(os.path.relpath(p, TESTS) for p in python_files() if p.endswith("__init__.py"))
    assert packages == [os.path.join("helpers", "__init__.py")]
