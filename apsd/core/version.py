"""The installed distribution's version (``0+unknown`` in a source tree that was not installed)."""

from importlib.metadata import PackageNotFoundError, version

try:
    VERSION = version("apsd")
except PackageNotFoundError:  # running from a source tree that was not installed
    VERSION = "0+unknown"
