"""Where the repository, the tests, their fixtures and the launched helper scripts are."""

import os

HELPERS = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.dirname(HELPERS)
ROOT = os.path.dirname(TESTS)
FIXTURES = os.path.join(TESTS, "fixtures")
DEEPSPEED_FIXTURES = os.path.join(FIXTURES, "deepspeed")


def script(name: str) -> str:
    """The path of a helper script run as a process (``python <path>``, torchrun)."""
    return os.path.join(HELPERS, name)


def child_env(env: dict | None = None) -> dict:
    """``env`` (default: this process's) with the repository and tests/ first on PYTHONPATH, so
    that a child process imports ``offload_engine`` and ``helpers.<module>`` as the tests do."""
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, TESTS, env.get("PYTHONPATH")) if p)
    return env
