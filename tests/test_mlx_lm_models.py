"""mlx-lm's model modules found without its package __init__ (manifests/mlx_lm_models.py):
the same module as mlx-lm's own lookup for every model type it ships, and a conversion's
validation that never imports transformers (issue 40: ~0.8 s of the command's start)."""

from __future__ import annotations

import json
import os
import pkgutil
import subprocess
import sys
import textwrap

import pytest

from checkpoints import write_llama_checkpoint
from turboquant.manifests import architecture, mlx_lm_models


def _model_types() -> list[str]:
    import mlx_lm.models

    return sorted(m.name for m in pkgutil.iter_modules(mlx_lm.models.__path__))


def test_tables_are_mlx_lms_own():
    from mlx_lm import utils

    assert mlx_lm_models.remapping_tables() == (utils.MODEL_REMAPPING,
                                                utils.MODEL_ARCHITECTURE_REMAPPING)


def test_every_model_type_resolves_as_get_classes_does():
    from mlx_lm.utils import MODEL_ARCHITECTURE_REMAPPING, MODEL_REMAPPING, _get_classes

    configs = [{"model_type": t} for t in _model_types()]
    configs += [{"model_type": t} for t in MODEL_REMAPPING]
    configs += [{"model_type": t, "architectures": [a]} for t, a in MODEL_ARCHITECTURE_REMAPPING]
    configs += [{"model_type": t, "architectures": a} for t, a in MODEL_ARCHITECTURE_REMAPPING]
    checked = 0
    for config in configs:
        try:
            want = _get_classes(config)[0].__module__
        except (ValueError, AttributeError, SystemExit):  # helpers (base, cache), olmo
            continue
        assert architecture.model_module(config).__name__ == want, config
        checked += 1
    assert checked > 100


def test_unknown_model_type_is_refused_as_before():
    with pytest.raises(architecture.ArchitectureError, match="no_such_model"):
        architecture.model_module({"model_type": "no_such_model"})


def test_without_tables_mlx_lms_lookup_is_used(monkeypatch):
    monkeypatch.setattr(mlx_lm_models, "remapping_tables", lambda: None)
    assert mlx_lm_models.model_module({"model_type": "mistral"}).__name__ == \
        "mlx_lm.models.llama"


FRESH = textwrap.dedent("""
    import json, sys
    from turboquant.manifests.mlx_lm_models import model_module
    mod = model_module({"model_type": "llama"})
    before = sorted(m for m in ("transformers", "mlx_lm.utils", "mlx_lm.convert")
                    if m in sys.modules)
    import os
    advisory = os.environ.get("TRANSFORMERS_NO_ADVISORY_WARNINGS")
    from mlx_lm.utils import load_config  # a module of the package, before its __init__
    import mlx_lm
    from mlx_lm import load   # the package's own __init__ runs now
    import mlx_lm.models.llama as again
    print(json.dumps({"before": before, "module": mod.__name__, "same": again is mod,
                      "version": mlx_lm.__version__, "load": load.__module__,
                      "transformers": "transformers" in sys.modules, "advisory": advisory,
                      "config": load_config.__module__}))
""")


def test_model_module_skips_the_package_init_until_it_is_used():
    env = {k: v for k, v in os.environ.items() if k != "TRANSFORMERS_NO_ADVISORY_WARNINGS"}
    out = subprocess.run([sys.executable, "-c", FRESH], capture_output=True, text=True,
                         check=True, env=env)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["before"] == []  # neither transformers nor mlx-lm's utils for the model
    assert got["module"] == "mlx_lm.models.llama" and got["same"]
    assert got["version"] and got["load"] == "mlx_lm.utils" and got["transformers"]
    assert got["advisory"] == "1" and got["config"] == "mlx_lm.utils"


def test_validation_imports_no_transformers(tmp_path):
    src = tmp_path / "src"
    write_llama_checkpoint(src)
    code = textwrap.dedent(f"""
        import sys
        from turboquant.pipeline.convert import ConvertOptions, validate
        p = validate(ConvertOptions(source={str(src)!r}, output={str(tmp_path / 'out')!r},
                                    bits=4, group_size=64))
        assert p.plan.jobs
        print(sorted(m for m in ("transformers", "mlx_lm.utils") if m in sys.modules))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]"
