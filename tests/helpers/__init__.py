"""Code the tests share: builders of checkpoints and stores, harnesses, and the scripts tests
launch as processes. No tests here; tests import ``helpers.<module>`` (pyproject.toml puts
tests/ on pytest's path; a launched script gets it from ``helpers.paths.child_env``)."""
