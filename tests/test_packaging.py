"""What `pip install .` ships: every folder of the package declared, its data files included,
and nothing in it importing the workshop folders (benchmarks/, tools/)."""
import ast
import tomllib
from fnmatch import fnmatch
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SETUPTOOLS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def _package_dirs() -> dict[str, Path]:
    """Each declared package and the folder it is built from."""
    mapped = SETUPTOOLS["package-dir"]
    dirs = {}
    for name in SETUPTOOLS["packages"]:
        parent, _, leaf = name.rpartition(".")
        dirs[name] = ROOT / mapped[name] if name in mapped else dirs[parent] / leaf
    return dirs


def test_every_folder_with_files_is_a_declared_package():
    """setuptools warns (and may one day drop) a folder inside a package that is not itself
    declared, such as manifests/recipes/ of data files."""
    dirs = _package_dirs()
    declared = set(dirs.values())
    for name in ("turboquant.stages", "turboquant.manifests", "turboquant.pipeline",
                 "turboquant.kernels", "turboquant.runtime"):
        for sub in dirs[name].rglob("*"):
            if sub.is_dir() and sub.name != "__pycache__" and any(p.is_file() for p in sub.iterdir()):
                assert sub in declared, (
                    f"{sub.relative_to(ROOT)} holds files but is not in pyproject.toml's "
                    "[tool.setuptools] packages: add it there (and its files to package-data)")


def test_recipe_files_are_package_data():
    dirs = _package_dirs()
    recipes = dirs["turboquant.manifests.recipes"]
    patterns = SETUPTOOLS["package-data"]["turboquant.manifests.recipes"]
    files = [p for p in recipes.iterdir() if p.suffix in (".toml", ".json")]
    assert files, f"no recipe files found in {recipes}"
    for f in files:
        assert any(fnmatch(f.name, pat) for pat in patterns), (
            f"{f.relative_to(ROOT)} is not matched by package-data {patterns}: a wheel would lack it")


def test_package_never_imports_benchmarks_or_tools():
    for name, folder in _package_dirs().items():
        for path in folder.glob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0:
                    names = [node.module or ""]
                else:
                    continue
                for mod in names:
                    assert mod.split(".")[0] not in ("benchmarks", "tools"), (
                        f"{path.relative_to(ROOT)} imports {mod}: the package must not depend "
                        "on benchmarks/ or tools/; move what it needs into the package")
