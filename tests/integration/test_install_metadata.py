"""Installing prints no setuptools deprecation banner: the package metadata is read clean."""

import tomllib
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_license_is_an_spdx_string_and_the_build_needs_a_setuptools_that_reads_it():
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert pyproject["project"]["license"] == "Apache-2.0"
    assert "setuptools>=77" in pyproject["build-system"]["requires"]


def test_setuptools_applies_the_project_table_without_a_warning(monkeypatch):
    """What `pip install` runs through setuptools' build backend: a deprecation warning
    there is the banner printed (twice) on every install."""
    from setuptools.config.pyprojecttoml import apply_configuration
    from setuptools.dist import Distribution
    monkeypatch.chdir(ROOT)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dist = apply_configuration(Distribution(), "pyproject.toml")
    assert dist.metadata.license_expression == "Apache-2.0"
