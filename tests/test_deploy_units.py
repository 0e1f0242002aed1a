"""Deployments without a server: one per recipe family, defaults that resolve to the
family's own recipe, prefect.yaml in step with the recipes, the resume automations."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

from turboquant.manifests.recipe import list_recipes, load_recipe
from turboquant.pipeline import deploy as d

REPO = Path(__file__).resolve().parents[1]


def test_prefect_yaml_matches_the_recipes():
    assert (REPO / "prefect.yaml").read_text() == d.prefect_yaml(), \
        "prefect.yaml is stale: regenerate it with `python -m turboquant.deploy --print-yaml`"
    import yaml

    doc = yaml.safe_load((REPO / "prefect.yaml").read_text())
    names = [x["name"] for x in doc["deployments"]]
    assert names == list_recipes()
    for x in doc["deployments"]:
        assert x["entrypoint"] == "turboquant.pipeline.flow.convert_flow"
        assert x["parameters"] == d.family_parameters(x["name"])
        assert x["work_pool"]["name"] == d.DEFAULT_POOL


@pytest.mark.parametrize("family", list_recipes())
def test_family_defaults_resolve_to_the_family_recipe(family):
    from turboquant.pipeline.flow import convert_flow

    params = d.family_parameters(family)
    assert params["recipe"] == family
    recipe = load_recipe(family)
    overrides = {k: v for k, v in params.items() if k != "recipe"}
    assert recipe.with_overrides(**overrides).hash() == recipe.hash()
    assert set(params) <= set(inspect.signature(convert_flow.fn).parameters)
    assert params.get("group_size") == recipe.group_size


def test_runner_deployments_import_the_flow_by_module_path():
    deps = d.family_deployments(pool="p", selected=["llama", "mixtral"], work_queue="q",
                                job_variables={"env": {"A": "1"}})
    assert [x.name for x in deps] == ["llama", "mixtral"]
    for x in deps:
        assert x.entrypoint == d.ENTRYPOINT and x.work_pool_name == "p"
        assert x.work_queue_name == "q" and x.job_variables == {"env": {"A": "1"}}
        assert d.TAG in x.tags and x.parameters == d.family_parameters(x.name)
    with pytest.raises(ValueError, match="unknown family nope"):
        d.families(["llama", "nope"])


def test_resume_automations():
    stalled, resume = d.resume_automations(max_resumes=2, stalled_after=45)
    assert stalled.trigger.posture == "Proactive"
    assert stalled.trigger.within.total_seconds() == 45
    assert stalled.actions[0].state == "CRASHED"
    assert resume.trigger.expect == {"prefect.flow-run.Crashed"}
    assert resume.trigger.match.root["prefect.run-count"] == ["0", "1", "2"]  # 2 resumes
    assert resume.actions[0].state == "SCHEDULED" and resume.actions[0].name == "AwaitingRetry"
    for a in (stalled, resume):
        assert a.trigger.match_related.root["prefect.resource.id"] == f"prefect.tag.{d.TAG}"


def test_cli_without_a_server(capsys, monkeypatch):
    from turboquant.deploy import main

    assert main(["--list", "--family", "llama", "--pool", "gpu"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("turboquant-convert/llama  pool=gpu  recipe=llama")
    assert main(["--print-yaml"]) == 0
    assert capsys.readouterr().out == d.prefect_yaml()
    assert main(["--family", "nope"]) == 2
    assert "unknown family" in capsys.readouterr().err
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(restore_defaults={PREFECT_API_URL}):
        assert main(["--family", "llama"]) == 2
    assert "no Prefect server" in capsys.readouterr().err
