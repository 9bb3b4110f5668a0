"""apsd: a multi-tenant inference scheduler daemon with Adaptive Priority Scheduling.

The public surface for plugin authors is re-exported here; see docs/plugins.md.
"""

from importlib.metadata import PackageNotFoundError, version

from .config import Config as Config
from .config import ConfigError as ConfigError
from .config import parse_section as parse_section
from .hookspecs import hookimpl as hookimpl
from .models import InferenceRequest as InferenceRequest
from .policy import GovernorReading as GovernorReading
from .policy import PolicyRegistry as PolicyRegistry

try:
    __version__ = version("apsd")
except PackageNotFoundError:  # running from a source tree that was not installed
    __version__ = "0+unknown"
