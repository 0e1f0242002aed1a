"""Shared pytest fixtures.

``hub_server``: a loopback Hugging Face Hub (tests/hub_server.py) with the real
``huggingface_hub`` client pointed at it. Per test: a fresh server and storage folder, a fresh
``HF_HOME`` (so an empty download cache), ``HF_ENDPOINT`` and a dummy ``HF_TOKEN`` set, Xet
disabled (uploads take the LFS route the server implements), telemetry off. Everything is
restored afterwards. Works whether ``huggingface_hub`` was imported before the test or not: the
values it read at import time are patched too (see ``hub_server.hub_client_env``). Code under
test should build ``HfApi()`` at call time, not at import time, or pass ``endpoint=`` explicitly.

The fixture yields the ``HubServer``, with a few extras::

    def test_publish(hub_server, tmp_path):
        api = hub_server.api()                      # HfApi(endpoint=hub_server.url, token=...)
        api.create_repo("test-user/m")              # or huggingface_hub.create_repo(...)
        api.upload_folder(repo_id="test-user/m", folder_path=tmp_path / "out")
        assert hub_server.lfs_uploads["test-user/m"] == 1   # LFS objects received
        assert hub_server.commits["test-user/m"] == 1       # commits received
        with hub_server.offline():                  # HF_HUB_OFFLINE=1 for the client
            ...

Attributes: ``url``, ``root`` (storage folder), ``hf_home``, ``cache_dir`` (``$HF_HOME/hub``),
``client_token`` (the dummy ``HF_TOKEN``; the server accepts any token), ``user`` (``whoami``).
Counters keyed by repo id (``"datasets/<id>"`` for datasets): ``lfs_uploads``, ``lfs_bytes``,
``committed_files``, ``commits``; ``requests`` lists (method, path) of every request.
Helpers: ``head()``, ``list_files()``, ``read_file()``, ``history()``, ``reset_stats()``.

For other server options (a required token, multipart LFS uploads), build one directly::

    with HubServer(tmp_path / "hub", token="secret") as hub, \\
            hub_client_env(hub.url, tmp_path / "home", token="secret"):
        ...
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

if str(Path(__file__).parent) not in sys.path:  # `import hub_server` in any pytest import mode
    sys.path.insert(0, str(Path(__file__).parent))

from hub_server import HubServer, hub_client_env, hub_offline  # noqa: E402

HUB_TEST_TOKEN = "hf_loopback_test_token"


@pytest.fixture
def hub_server(tmp_path_factory):
    base = tmp_path_factory.mktemp("hub")
    home = base / "hf_home"
    with HubServer(base / "storage") as server, hub_client_env(server.url, home, HUB_TEST_TOKEN) as cache:
        from huggingface_hub import HfApi

        server.hf_home = home
        server.cache_dir = cache
        server.client_token = HUB_TEST_TOKEN
        server.api = lambda: HfApi(endpoint=server.url, token=HUB_TEST_TOKEN)
        server.offline = hub_offline
        yield server


@pytest.fixture(scope="module")
def tq_repo(tmp_path_factory):
    """A tiny 4-bit Llama-shaped TurboQuant repo (the serve tests share it)."""
    from test_runtime_fixtures import make_checkpoint, write_repo

    path = tmp_path_factory.mktemp("tq") / "tiny-tq"
    config, weights = make_checkpoint("llama")
    write_repo(path, config, weights, bits=4)
    return path
