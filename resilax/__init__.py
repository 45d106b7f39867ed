"""resilax: JAX training that survives device, host and slice failures.

    step = resilax.wrap(train_step, topology=resilax.Topology.emulated(2, 4), config=resilax.Config(...))
    state = step.init(state)
    for batch in batches:
        state, metrics = step(state, batch)
    step.close()
"""

import importlib
from typing import TYPE_CHECKING

# Names load on first use (PEP 562): `import resilax` alone imports no JAX, so the processes
# that only supervise (`resilax launch`, `resilax agent`, `--help`) start in a tenth of the
# time, and one that trains imports what `resilax.wrap` needs when it first asks for it.
_WHERE = {
    "AnomalyError": "resilax._src.protect.anomaly",
    **dict.fromkeys(("AnomalyConfig", "CheckpointConfig", "Config", "LogConfig", "PeersConfig", "VerifyConfig",
                     "DeterministicConfig", "HealthConfig"), "resilax._src.config"),
    **dict.fromkeys(("CheckpointError", "ConfigError", "CorruptCheckpointError", "ReplayLogError",
                     "PipelineError",
    "PipelineExecutor",
    "PipelineModel", "ProgramMismatchError", "Preempted", "ResilaxError", "StateLostError",
                     "SilentDataCorruptionError", "StorageError", "TopologyError", "WrapError"), "resilax._src.errors"),
    "Event": "resilax._src.events",
    "exclusive_orbax_save": "resilax._src.protect.checkpoints",
    "orbax_lock": "resilax._src.protect.checkpoints",
    "read_checkpoint": "resilax._src.protect.reading",
    "Fault": "resilax._src.runtime.faults",
    "FaultPlan": "resilax._src.runtime.faults",
    "record": "resilax._src.step.record",
    "pipeline": "resilax._src.pipeline.spmd",
    "PipelineExecutor": "resilax._src.pipeline.executor",
    "PipelineModel": "resilax._src.pipeline.executor",
    "pipeline_sharding": "resilax._src.pipeline.spmd",
    "request_cpu_devices": "resilax._src.runtime.cpu_devices",
    "Topology": "resilax._src.runtime.topology",
    "ResilientStep": "resilax._src.step.driver",
    "wrap": "resilax._src.step.driver",
}


def __getattr__(name: str):
    if name == "launched":  # the worker side of `resilax launch`
        return importlib.import_module("resilax.launched")
    if name in _WHERE:
        value = getattr(importlib.import_module(_WHERE[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'resilax' has no attribute {name!r}")


def __dir__():
    return sorted([*globals(), *_WHERE, "launched"])


if TYPE_CHECKING:  # for type checkers and IDEs: the same names, imported eagerly
    from resilax._src.protect.anomaly import AnomalyError as AnomalyError  # noqa: F401
    from resilax._src.config import (AnomalyConfig as AnomalyConfig, CheckpointConfig as CheckpointConfig,  # noqa: F401
                                     Config as Config, DeterministicConfig as DeterministicConfig,
                                     HealthConfig as HealthConfig, LogConfig as LogConfig, PeersConfig as PeersConfig,
                                     VerifyConfig as VerifyConfig)
    from resilax._src.errors import (CheckpointError as CheckpointError, ConfigError as ConfigError,  # noqa: F401
                                     CorruptCheckpointError as CorruptCheckpointError, PipelineError as PipelineError,
                                     Preempted as Preempted,
                                     ProgramMismatchError as ProgramMismatchError, ReplayLogError as ReplayLogError,
                                     ResilaxError as ResilaxError, SilentDataCorruptionError as SilentDataCorruptionError,
                                     StateLostError as StateLostError, StorageError as StorageError,
                                     TopologyError as TopologyError, WrapError as WrapError)
    from resilax._src.events import Event as Event  # noqa: F401
    from resilax._src.protect.checkpoints import (exclusive_orbax_save as exclusive_orbax_save,  # noqa: F401
                                                  orbax_lock as orbax_lock)
    from resilax._src.protect.reading import read_checkpoint as read_checkpoint  # noqa: F401
    from resilax._src.runtime.faults import Fault as Fault, FaultPlan as FaultPlan  # noqa: F401
    from resilax._src.pipeline.spmd import pipeline as pipeline, pipeline_sharding as pipeline_sharding  # noqa: F401
    from resilax._src.pipeline.executor import (PipelineExecutor as PipelineExecutor,  # noqa: F401
                                                PipelineModel as PipelineModel)
    from resilax._src.step.record import record as record  # noqa: F401
    from resilax._src.runtime.cpu_devices import request_cpu_devices as request_cpu_devices  # noqa: F401
    from resilax._src.runtime.topology import Topology as Topology  # noqa: F401
    from resilax._src.step.driver import ResilientStep as ResilientStep, wrap as wrap  # noqa: F401
    from resilax import launched as launched  # noqa: F401

__version__ = "0.1.0"

__all__ = [
    "AnomalyConfig",
    "AnomalyError",
    "CheckpointConfig",
    "LogConfig",
    "PeersConfig",
    "PipelineError",
    "PipelineExecutor",
    "PipelineModel",
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
    "exclusive_orbax_save",
    "launched",
    "orbax_lock",
    "pipeline",
    "pipeline_sharding",
    "read_checkpoint",
    "record",
    "request_cpu_devices",
    "wrap",
]
