"""The one parser of offload-engine's on/off environment variables (``OFFLOAD_ENGINE_IO_PROBE``,
``OFFLOAD_ENGINE_HUGE_PAGES``).

A switch is set by hand in job scripts and container specs, spelled as each person spells
it: ``0``, ``false``, ``no`` and ``off`` turn it off, ``1``, ``true``, ``yes`` and ``on`` turn
it on (any case, surrounding spaces ignored); unset or empty is the default. Anything else
(``fasle``, ``2``, ``disabled``) is refused with an error naming the variable, rather than
read as "on" and silently doing what the user tried to turn off.
"""

from __future__ import annotations

import os

from .errors import InputError

OFF = ("0", "false", "no", "off")
ON = ("1", "true", "yes", "on")


def parse_flag(name: str, raw: str | None, default: bool) -> bool:
    """``raw`` (the value of variable ``name``, None when unset) as on/off; ``default`` when
    unset or blank. Raises ``InputError`` naming ``name`` for any other spelling."""
    if raw is None or not raw.strip():
        return default
    value = raw.strip().lower()
    if value in OFF:
        return False
    if value in ON:
        return True
    shown = raw if len(raw) <= 40 else raw[:40] + "..."
    raise InputError(f"environment variable {name}={shown!r}: expected one of "
                     f"{', '.join(OFF)} (off) or {', '.join(ON)} (on), any case")


def env_flag(name: str, default: bool) -> bool:
    """The on/off environment variable ``name`` (see ``parse_flag``)."""
    return parse_flag(name, os.environ.get(name), default)
