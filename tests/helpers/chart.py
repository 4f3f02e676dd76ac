"""The Helm chart in charts/kvfence rendered offline with helm-python-sdk (Helm's Go SDK, no helm
binary), for the chart's tests: the renderer, a render's manifests, and the chart's values and
their schema."""

import copy
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "kvfence"
RELEASE, NAMESPACE = "kvfence", "kvfence-system"
KUBERNETES_VERSION = "1.30"


def load_helm() -> Any:
    """The renderer. It is in the test extra; if it cannot load here, say why and fail."""
    try:
        import helm_python

        helm_python.helm_sdk_version()  # loads libhelm_c
    except Exception as exc:
        pytest.fail(
            f"helm-python-sdk cannot render charts here: {type(exc).__name__}: {exc}. "
            "It comes with the test extra: pip install -e '.[test]'"
        )
    return helm_python


def render(helm: Any, values: dict[str, Any] | None = None) -> dict[str, str]:
    with helm.Chart.load(CHART) as chart:
        return chart.render(values, name=RELEASE, namespace=NAMESPACE)


def manifests(rendered: Mapping[str, str]) -> list[dict[str, Any]]:
    return [
        doc
        for path, text in sorted(rendered.items())
        if path.endswith(".yaml")
        for doc in yaml.safe_load_all(text)
        if doc is not None
    ]


def of_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def schema() -> dict[str, Any]:
    return json.loads((CHART / "values.schema.json").read_text())


def default_values() -> dict[str, Any]:
    return yaml.safe_load((CHART / "values.yaml").read_text())


def merged(base: Mapping[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    """Helm's coalescing: maps merge, everything else is replaced."""
    result = copy.deepcopy(dict(base))
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(result.get(key), Mapping):
            result[key] = merged(result[key], value)
        else:
            result[key] = copy.deepcopy(value)
    return result
