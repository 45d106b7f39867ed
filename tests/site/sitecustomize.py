"""Test speed only, for every Python process the suite starts (conftest puts this directory
on PYTHONPATH): JAX's persistent-cache key leaves out the device assignment on CPU, as JAX's
own key already does on GPU (`jax._src.cache_key`, ``strip_device_assignment``).

The suite compiles the same program for many same-sized sets of emulated devices: the
bit-exact mode's executables per failure domain, the default mode's program of every mesh
one more loss would leave, the survivors' mesh after a shrink, each worker of a launched
job its own domain. With the device ids in the key each is a cold compile; without them the
second and later ones load the first's executable from the cache onto their own devices
(the device assignment passed at load is the real one, so the executable runs where it was
asked to; the bits are those of a compile). Nothing outside the suite is changed: resilax
does not depend on it."""

import importlib.abc
import importlib.util
import sys


def _patch(mod) -> None:
    orig = mod._hash_serialized_compile_options

    def _hash(hash_obj, compile_options_obj, strip_device_assignment=False):
        return orig(hash_obj, compile_options_obj, strip_device_assignment=True)

    def _hash_devices(hash_obj, accelerators) -> None:
        # JAX hashes XLA:CPU's topology fingerprint here, which differs from one process of a
        # job to the next for the same devices: each worker of a launched job had keys of
        # its own, and none loaded what another (or an earlier job's) process had compiled.
        # What the executable depends on is the same in every process: the platform, the
        # device kinds and how the devices fall into processes (numbered in order of first
        # appearance, so one process's program on its own devices is the same everywhere).
        devs = list(accelerators.flat)
        order = {p: i for i, p in enumerate(dict.fromkeys(d.process_index for d in devs))}
        mod._hash_string(hash_obj, repr([(d.platform, d.device_kind, order[d.process_index]) for d in devs]))

    mod._hash_serialized_compile_options = _hash
    mod._hash_accelerator_config = _hash_devices


def _patch_compiler(mod) -> None:
    """With ``jax_share_binary_between_hosts``, one process of a job compiles each program
    of the job's mesh and the others load it from the coordination service's key-value
    store; JAX keeps what it shared in a process-wide dict by cache key. A worker that
    re-forms in place starts a new distributed client (and backend) under the same keys:
    the dict is emptied when the client changes, so nothing of an old client is reused."""
    orig = mod._compile_and_share_module
    last = [None]

    def share(backend, computation, executable_devices, compile_options, host_callbacks, global_client, *a, **kw):
        if global_client is not last[0]:
            orig.modules_cache.clear()
            last[0] = global_client
        return orig(backend, computation, executable_devices, compile_options, host_callbacks, global_client,
                    *a, **kw)

    share.modules_cache = orig.modules_cache  # (the original reads it through the module's name)
    mod._compile_and_share_module = share


_PATCHES = {"jax._src.cache_key": _patch, "jax._src.compiler": _patch_compiler}


class _PatchJax(importlib.abc.MetaPathFinder):
    """Patches `jax._src.cache_key` and `jax._src.compiler` when each is first imported (this
    process may never import JAX: importing it here would cost every such process its
    start-up)."""

    def __init__(self, todo):
        self.todo = dict(todo)

    def find_spec(self, name, path, target=None):
        patch = self.todo.pop(name, None)
        if patch is None:
            return None
        if not self.todo:
            sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            patch(module)

        spec.loader.exec_module = exec_and_patch
        return spec


_todo = {}
for _name, _fn in _PATCHES.items():
    if _name in sys.modules:
        _fn(sys.modules[_name])
    else:
        _todo[_name] = _fn
if _todo:
    sys.meta_path.insert(0, _PatchJax(_todo))


def _chain() -> None:
    """Python imports one ``sitecustomize``: this one, being first on PYTHONPATH. Runs the one
    the environment would have imported otherwise (a later entry of ``sys.path``), so that
    the suite's processes keep what the machine's own sitecustomize sets up."""
    import os

    here = os.path.dirname(os.path.abspath(__file__))
    for entry in sys.path:
        if not entry or os.path.abspath(entry) == here:
            continue
        path = os.path.join(entry, "sitecustomize.py")
        if os.path.isfile(path):
            spec = importlib.util.spec_from_file_location("_resilax_next_sitecustomize", path)
            if spec is not None and spec.loader is not None:
                spec.loader.exec_module(importlib.util.module_from_spec(spec))
            return


_chain()
