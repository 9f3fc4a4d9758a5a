"""The one error of a configuration, and the check every section and objective raises it with."""
from __future__ import annotations


class ConfigError(ValueError):
    """A configuration value that cannot be used; the message names the field and the fix."""



def require(condition: bool, field_name: str, message: str) -> None:
    """One ConfigError naming `field_name` unless `condition` (objectives' validate() use it too)."""
    if not condition:
        raise ConfigError(f"{field_name}: {message}")


def one_line(err: Exception) -> str:
    return " ".join(str(err).split())
