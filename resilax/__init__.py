"""resilax: JAX training that survives device, host and slice failures.

    step = resilax.wrap(train_step, topology=resilax.Topology.emulated(2, 4), config=resilax.Config(...))
    state = step.init(state)
    for batch in batches:
        state, metrics = step(state, batch)
    step.close()
"""

from resilax._src.protect.anomaly import AnomalyError as AnomalyError
from resilax._src.config import (
    AnomalyConfig as AnomalyConfig,
    CheckpointConfig as CheckpointConfig,
    Config as Config,
    LogConfig as LogConfig,
    PeersConfig as PeersConfig,
    VerifyConfig as VerifyConfig,
    DeterministicConfig as DeterministicConfig,
    HealthConfig as HealthConfig,
)
from resilax._src.errors import (
    CheckpointError as CheckpointError,
    ConfigError as ConfigError,
    CorruptCheckpointError as CorruptCheckpointError,
    ReplayLogError as ReplayLogError,
    ProgramMismatchError as ProgramMismatchError,
    Preempted as Preempted,
    ResilaxError as ResilaxError,
    StateLostError as StateLostError,
    SilentDataCorruptionError as SilentDataCorruptionError,
    StorageError as StorageError,
    TopologyError as TopologyError,
    WrapError as WrapError,
)
from resilax._src.events import Event as Event
from resilax._src.runtime.faults import Fault as Fault, FaultPlan as FaultPlan
from resilax._src.step.record import record as record
from resilax._src.runtime.topology import Topology as Topology
from resilax._src.step.driver import ResilientStep as ResilientStep, wrap as wrap
from resilax import launched as launched  # the worker side of `resilax launch`

__version__ = "0.1.0"

__all__ = [
    "AnomalyConfig",
    "AnomalyError",
    "CheckpointConfig",
    "LogConfig",
    "PeersConfig",
    "Preempted",
    "ProgramMismatchError",
    "VerifyConfig",
    "DeterministicConfig",
    "HealthConfig",
    "SilentDataCorruptionError",
    "CheckpointError",
    "Config",
    "ConfigError",
    "CorruptCheckpointError",
    "Event",
    "Fault",
    "FaultPlan",
    "ReplayLogError",
    "ResilaxError",
    "ResilientStep",
    "StateLostError",
    "StorageError",
    "Topology",
    "TopologyError",
    "WrapError",
    "launched",
    "record",
    "wrap",
]
