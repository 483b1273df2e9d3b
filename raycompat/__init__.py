"""raycompat: upgrade the embedding model of a large retrieval gallery without re-encoding
everything first (docs/README.md).

``__version__`` is the installed distribution's version (its metadata); from a checkout that is
not installed, the version in its ``pyproject.toml``. Every model bundle and report records it.
"""

from __future__ import annotations


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("raycompat")
    except PackageNotFoundError:  # a checkout on sys.path, not installed
        import os

        pyproject = os.path.join(os.path.dirname(os.path.dirname(__file__)), "pyproject.toml")
        try:
            import tomllib  # Python 3.11+

            with open(pyproject, "rb") as fh:
                return str(tomllib.load(fh)["project"]["version"])
        except (ImportError, OSError, KeyError, ValueError):
            return "unknown"


__version__ = _version()
