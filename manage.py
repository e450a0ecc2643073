#!/usr/bin/env python
"""Django's command-line utility; puts platform/ on the path and reports bad settings in one line."""

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path[:0] = [str(ROOT), str(ROOT / "platform")]


def main() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "server.settings")
    from core.env import ConfigError
    from django.core.management import execute_from_command_line

    try:
        execute_from_command_line(sys.argv)
    except ConfigError as exc:
        sys.exit(f"configuration error: {exc}")


if __name__ == "__main__":
    main()
