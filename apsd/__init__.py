"""apsd: a multi-tenant inference scheduler daemon with Adaptive Priority Scheduling.

The names below are the public API for plugin authors and embedders (see
``docs/how-to/write-a-plugin.md``); everything else is internal and may change.
"""

from apsd.core.config import Config as Config
from apsd.core.config import ConfigError as ConfigError
from apsd.core.config import load_config as load_config
from apsd.core.config import parse_config as parse_config
from apsd.core.config import parse_section as parse_section
from apsd.core.hookspecs import hookimpl as hookimpl
from apsd.core.models import Batch as Batch
from apsd.core.models import Capacity as Capacity
from apsd.core.models import Completion as Completion
from apsd.core.models import Dispatch as Dispatch
from apsd.core.models import InferenceRequest as InferenceRequest
from apsd.core.models import Refusal as Refusal
from apsd.core.policy import BatchingPolicy as BatchingPolicy
from apsd.core.policy import Governor as Governor
from apsd.core.policy import GovernorReading as GovernorReading
from apsd.core.policy import OrderingPolicy as OrderingPolicy
from apsd.core.policy import PolicyRegistry as PolicyRegistry
from apsd.core.policy import PolicySet as PolicySet
from apsd.core.version import VERSION as __version__  # noqa: F401 (the public version)
from apsd.engines.profiles import GpuProfile as GpuProfile
from apsd.engines.profiles import ModelProfile as ModelProfile
from apsd.engines.profiles import ProfileRegistry as ProfileRegistry
from apsd.pipeline import Pipeline as Pipeline
from apsd.pipeline import open_pipeline as open_pipeline
from apsd.plugins import PluginError as PluginError
from apsd.plugins import build_policies as build_policies
from apsd.policies.fair import ChargeWeights as ChargeWeights
from apsd.policies.fair import FairShareQueue as FairShareQueue
from apsd.policies.fair import tenant_weights as tenant_weights
from apsd.store import Bucket as Bucket
from apsd.store import SharedService as SharedService
from apsd.store import Store as Store
