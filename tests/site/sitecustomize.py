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

    mod._hash_serialized_compile_options = _hash


class _PatchCacheKey(importlib.abc.MetaPathFinder):
    """Patches `jax._src.cache_key` when it is first imported (this process may never import
    JAX: importing it here would cost every such process its start-up)."""

    def find_spec(self, name, path, target=None):
        if name != "jax._src.cache_key":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            _patch(module)

        spec.loader.exec_module = exec_and_patch
        return spec


if "jax._src.cache_key" in sys.modules:
    _patch(sys.modules["jax._src.cache_key"])
else:
    sys.meta_path.insert(0, _PatchCacheKey())
