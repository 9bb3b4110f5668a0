"""apsd: a multi-tenant inference scheduler daemon with Adaptive Priority Scheduling.

The names below are the public API for plugin authors and embedders (see
``docs/plugins.md``); everything else is internal and may change.
"""

from importlib.metadata import PackageNotFoundError, version

from .config import Config as Config
from .config import ConfigError as ConfigError
from .config import load_config as load_config
from .config import parse_config as parse_config
from .config import parse_section as parse_section
from .hookspecs import hookimpl as hookimpl
from .engines.profiles import GpuProfile as GpuProfile
from .engines.profiles import ModelProfile as ModelProfile
from .engines.profiles import ProfileRegistry as ProfileRegistry
from .models import Batch as Batch
from .models import Capacity as Capacity
from .models import Completion as Completion
from .models import Dispatch as Dispatch
from .models import InferenceRequest as InferenceRequest
from .models import Refusal as Refusal
from .pipeline import Pipeline as Pipeline
from .pipeline import open_pipeline as open_pipeline
from .plugins import PluginError as PluginError
from .plugins import build_policies as build_policies
from .policies.fair import ChargeWeights as ChargeWeights
from .policies.fair import FairShareQueue as FairShareQueue
from .policies.fair import tenant_weights as tenant_weights
from .policy import BatchingPolicy as BatchingPolicy
from .policy import Governor as Governor
from .policy import GovernorReading as GovernorReading
from .policy import OrderingPolicy as OrderingPolicy
from .policy import PolicyRegistry as PolicyRegistry
from .policy import PolicySet as PolicySet
from .store import Bucket as Bucket
from .store import SharedService as SharedService
from .store import Store as Store

try:
    __version__ = version("apsd")
except PackageNotFoundError:  # running from a source tree that was not installed
    __version__ = "0+unknown"
