"""prefect.yaml: valid for Prefect, and every deployment's parameters are a valid BuildConfig."""

from __future__ import annotations

from pathlib import Path

import yaml
from prefect.cli.deploy._models import PrefectYamlModel  # private: prefect is pinned to 3.9.x in tests

from flows.build import build_cache
from infra.config import BuildConfig

ROOT = Path(__file__).resolve().parents[1]


def test_prefect_yaml_validates_and_parameters_are_build_configs():
    model = PrefectYamlModel.model_validate(yaml.safe_load((ROOT / "prefect.yaml").read_text()))
    assert {d.name for d in model.deployments} >= {"build-cache"}
    for deployment in model.deployments:
        path, _, name = deployment.entrypoint.partition(":")
        assert (ROOT / path).is_file() and name == "build_cache"
        BuildConfig.model_validate(deployment.parameters["config"])


def test_the_flow_form_is_the_typed_config():
    schema = build_cache.parameters.model_dump()
    assert schema["required"] == ["config"]
    config_schema = schema["definitions"]["BuildConfig"]
    assert config_schema["additionalProperties"] is False
    assert {"source", "model", "out", "frames", "height", "width", "dtype"} <= set(config_schema["properties"])
    assert config_schema["properties"]["dtype"]["enum"] == ["bf16", "fp32"]
