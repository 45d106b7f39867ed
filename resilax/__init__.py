"""resilax: JAX training that survives device, host and slice failures.

    step = resilax.wrap(train_step, topology=resilax.Topology.emulated(2, 4), config=resilax.Config(...))
    state = step.init(state)
    for batch in batches:
        state, metrics = step(state, batch)
    step.close()
"""

from ._anomaly import AnomalyError as AnomalyError
from ._config import Config as Config
from ._errors import (
    CheckpointError as CheckpointError,
    ConfigError as ConfigError,
    CorruptCheckpointError as CorruptCheckpointError,
    ReplayLogError as ReplayLogError,
    ResilaxError as ResilaxError,
    StateLostError as StateLostError,
    StorageError as StorageError,
    TopologyError as TopologyError,
    WrapError as WrapError,
)
from ._events import Event as Event
from ._faults import Fault as Fault, FaultPlan as FaultPlan
from ._record import record as record
from ._topology import Topology as Topology
from ._transform import ResilientStep as ResilientStep, wrap as wrap

__version__ = "0.1.0"

__all__ = [
    "AnomalyError",
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
    "record",
    "wrap",
]
