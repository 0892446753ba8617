"""What the engines' imports need on a CPU machine without torchvision.

SGLang imports torchvision from multimodal configs that HiCache never runs, and vLLM
from the processors of models whose layers its tests build (MiniMax-M3's package); the
PyPI torchvision wheels link the CUDA build of libtorch ("operator torchvision::nms does
not exist" against the CPU torch). A stub package answers those imports instead.

transformers asks ``importlib.util.find_spec("torchvision")`` to decide whether to use it,
and the stub would answer yes; so its cached answer is taken first, while torchvision is
still honestly absent.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import sys
import types
from collections.abc import Iterator
from typing import Any

_STUB_VERSION = "0.0.0+kvconn.stub"


class _TorchvisionStub(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name == "torchvision" or name.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__version__ = _STUB_VERSION  # type: ignore[attr-defined]

        def attribute(name: str) -> Any:
            if name.startswith("__"):
                raise AttributeError(name)
            # any class a module-level annotation or default names
            return type(name, (), {})

        module.__getattr__ = attribute  # type: ignore[method-assign]
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass


def install_torchvision_stub() -> None:
    """Make ``import torchvision…`` succeed with an empty stub, once per process."""
    if any(isinstance(f, _TorchvisionStub) for f in sys.meta_path):
        return
    try:
        import torchvision  # noqa: F401  # a real one wins
    except ImportError:
        pass
    else:
        return
    from transformers.utils import import_utils

    import_utils.is_torchvision_available()  # cached: False, before the stub exists
    sys.meta_path.insert(0, _TorchvisionStub())


@contextlib.contextmanager
def torchvision_stubbed() -> Iterator[None]:
    """The stub for the imports made inside the block only: afterwards the finder and
    the stub's modules are gone, so later code of the process sees no torchvision (the
    modules imported meanwhile keep the stub's classes they bound)."""
    installed = not any(isinstance(f, _TorchvisionStub) for f in sys.meta_path)
    install_torchvision_stub()
    try:
        yield
    finally:
        if installed:
            sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _TorchvisionStub)]
            for name in [
                n for n in sys.modules if n == "torchvision" or n.startswith("torchvision.")
            ]:
                if getattr(sys.modules[name], "__version__", None) == _STUB_VERSION:
                    del sys.modules[name]
