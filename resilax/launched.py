"""The worker side of `resilax launch`, for a worker command of your own.

``resilax train`` needs none of this; a script of your own run by ``resilax launch``:

- `initialize` joins the job before any other JAX call (resilax calls it from
  ``Topology.domains`` and ``wrap`` too); `env` is the place the supervisor gave this
  process (None outside a launch); `is_primary` is True in the one process that writes
  job-wide outputs.
- Under ``--in-place --spares S`` the job can re-form without restarting this process:
  ``ResilientStep`` raises `Reform` at a step boundary (or after a failed step); catch it
  around the script's set-up and training, call `reattach`, and run the set-up again
  (`resilax.ResilientStep.init` resumes from the host stores)::

      while True:
          try:
              train()          # builds the topology, model, ResilientStep; trains
              break
          except resilax.launched.Reform:
              pass
          resilax.launched.reattach()

- `exit_if_shrunk` at the very end: a process that went on in place may hold threads that
  wait on the dead for good; it ends the process once the outputs are written.

See docs/multiprocess.md.
"""

from resilax._src.runtime.worker import (  # noqa: F401
    LaunchEnv as LaunchEnv,
    Reform as Reform,
    env as env,
    exit_if_shrunk as exit_if_shrunk,
    initialize as initialize,
    is_primary as is_primary,
    reattach as reattach,
)

__all__ = ["LaunchEnv", "Reform", "env", "exit_if_shrunk", "initialize", "is_primary", "reattach"]
