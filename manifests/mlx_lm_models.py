"""mlx-lm's model module for a config, imported without mlx-lm's package `__init__`.

`import mlx_lm.models.llama` first runs `mlx_lm/__init__.py`, which imports mlx-lm's
convert, generate and utils modules and through them transformers: ~0.8 s of one core
before a conversion's validation can build its skeleton (issue 40), for a model file that
needs only MLX. `model_module` imports the model's own module and nothing else:

- the model_type is resolved as mlx-lm's `_get_classes` resolves it, with mlx-lm's own
  remapping tables (MODEL_REMAPPING, MODEL_ARCHITECTURE_REMAPPING), read as literals from
  its `utils.py` source rather than by importing that module;
- where mlx-lm's package is not imported yet, it is entered in `sys.modules` with its
  `__init__` deferred: the first attribute anyone asks of the package itself
  (`mlx_lm.load`, `from mlx_lm import generate`, `mlx_lm.__version__`) runs the real
  `__init__` then, so code that uses the package later sees the whole of it; its modules
  (`mlx_lm.utils`, `mlx_lm.generate`) import as they would, with the one setting the
  `__init__` makes first (TRANSFORMERS_NO_ADVISORY_WARNINGS) already made.

Where the tables cannot be read (a release that moved them), mlx-lm's `_get_classes` is
used as before: slower, never wrong.
"""

from __future__ import annotations

import ast
import functools
import importlib
import importlib.util
import os
import sys

_TABLES = ("MODEL_REMAPPING", "MODEL_ARCHITECTURE_REMAPPING")


@functools.lru_cache(maxsize=1)
def remapping_tables() -> tuple[dict, dict] | None:
    """mlx-lm's (MODEL_REMAPPING, MODEL_ARCHITECTURE_REMAPPING), read from the source of
    `mlx_lm/utils.py` (module-level literals); None where they are not found as such."""
    spec = importlib.util.find_spec("mlx_lm")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(list(spec.submodule_search_locations)[0], "utils.py")
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        found = {}
        for node in tree.body:
            targets = node.targets if isinstance(node, ast.Assign) else (
                [node.target] if isinstance(node, ast.AnnAssign) and node.value else [])
            for t in targets:
                if isinstance(t, ast.Name) and t.id in _TABLES:
                    found[t.id] = ast.literal_eval(node.value)
    except (OSError, SyntaxError, ValueError):
        return None
    if set(found) != set(_TABLES) or not all(isinstance(v, dict) for v in found.values()):
        return None
    return found["MODEL_REMAPPING"], found["MODEL_ARCHITECTURE_REMAPPING"]


def resolve_model_type(config: dict, tables: tuple[dict, dict]) -> str:
    """The name of mlx-lm's model module for `config` (its `_get_classes` rule: an
    (model_type, architecture) remapping first, else the model_type remapping)."""
    remap, by_arch = tables
    model_type = config["model_type"]
    architectures = config.get("architectures") or ()
    if isinstance(architectures, str):
        architectures = (architectures,)
    for architecture in architectures:
        remapped = by_arch.get((model_type, architecture))
        if remapped is not None:
            return remapped
    return remap.get(model_type, model_type)


def _defer_package_init() -> None:
    """Enter mlx-lm's package in sys.modules with its `__init__` not run yet: run on the
    first attribute asked of the package (PEP 562's module `__getattr__`)."""
    if "mlx_lm" in sys.modules:
        return
    spec = importlib.util.find_spec("mlx_lm")
    if spec is None or spec.loader is None:
        return  # not installed: the import below says so
    pkg = importlib.util.module_from_spec(spec)

    def __getattr__(name: str):
        pkg.__dict__.pop("__getattr__", None)  # once: the real __init__ defines the rest
        spec.loader.exec_module(pkg)
        try:
            return pkg.__dict__[name]
        except KeyError:
            raise AttributeError(f"module 'mlx_lm' has no attribute {name!r}") from None

    pkg.__getattr__ = __getattr__
    # what the package's __init__ sets before its own imports: a later import of one of its
    # modules (mlx_lm.utils, which imports transformers) then runs as it would have
    os.environ["TRANSFORMERS_NO_ADVISORY_WARNINGS"] = "1"
    sys.modules["mlx_lm"] = pkg


def model_module(config: dict):
    """The module of mlx-lm's Model class for `config`'s model type (ImportError or ValueError where mlx-lm
    has none, as `_get_classes` raises)."""
    tables = remapping_tables()
    if tables is None:
        from mlx_lm.utils import _get_classes

        model_cls, _ = _get_classes(config)
        return importlib.import_module(model_cls.__module__)
    name = resolve_model_type(config, tables)
    _defer_package_init()
    try:
        arch = importlib.import_module(f"mlx_lm.models.{name}")
    except ImportError:  # as _get_classes reports it
        raise ValueError(f"Model type {name} not supported.") from None
    # the module of its Model class, as before: a few files re-export another's Model
    return importlib.import_module(arch.Model.__module__)
