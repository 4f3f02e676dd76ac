"""The metrics token Secret in the operator's namespace: created when missing, kept when it
exists (create-and-409: a GitOps tool's Secret is never regenerated), read by name; and the
scrapers' peer from the chart's JSON, refused with a message that says what is wrong."""

import base64
import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.memory_kube import MemoryKube
from helpers.waits import FACT_S
from kvfence_operator.cluster.metrics_token import (
    SCRAPERS_ENV,
    TOKEN_SECRET_ENV,
    metrics_access,
    metrics_token_sha256,
    scrapers_from,
)

NS, NAME = "kvfence-system", "kvfence-metrics-token"


def secret(token: str | None) -> dict:
    data = {"token": base64.b64encode(token.encode()).decode()} if token is not None else {}
    return {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": NAME}, "data": data}


def test_a_missing_token_secret_is_created_once_with_a_random_token():
    kube = MemoryKube()
    digest = metrics_token_sha256(kube, NS, NAME)
    assert kube.writes == [("create", "Secret", NAME)]
    token = base64.b64decode(kube.objects[("Secret", NAME)]["data"]["token"]).decode()
    assert len(token) >= 32 and digest == hashlib.sha256(token.encode()).hexdigest()
    assert metrics_token_sha256(kube, NS, NAME) == digest, "a restart keeps it"
    assert metrics_token_sha256(MemoryKube(), NS, NAME) != digest


def test_an_existing_token_secret_is_kept_and_used():
    kube = MemoryKube(secret("chosen-by-the-platform-team\n"))
    digest = metrics_token_sha256(kube, NS, NAME)
    assert digest == hashlib.sha256(b"chosen-by-the-platform-team").hexdigest()
    assert kube.writes == []


def test_a_token_secret_without_a_token_is_an_error_that_says_what_to_do():
    with pytest.raises(ValueError, match=rf"Secret {NS}/{NAME} has no 'token': put the metrics"):
        metrics_token_sha256(MemoryKube(secret(None)), NS, NAME)


def test_without_settings_there_is_no_token_and_no_scraper_rule():
    kube = MemoryKube()
    access = metrics_access(kube, NS, {})
    assert access.token_sha256 is None and access.scrapers == [] and kube.writes == []
    env = {TOKEN_SECRET_ENV: NAME, SCRAPERS_ENV: '[{"namespaceSelector": {}}]'}
    access = metrics_access(kube, NS, env)
    assert access.token_sha256 and access.scrapers == [{"namespaceSelector": {}}]


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("{nope", "is not JSON"),
        ('{"podSelector": {}}', "must be a list of NetworkPolicy peers"),
        ("[{}]", "each peer must be an object with namespaceSelector and/or podSelector"),
        ('[{"ipBlock": {"cidr": "10.0.0.0/8"}}]', "each peer must be an object with namespace"),
        ('[{"podSelector": {"app": "prometheus"}}]', "podSelector must be a label selector"),
        ('[{"namespaceSelector": "monitoring"}]', "namespaceSelector must be a label selector"),
    ],
)
def test_bad_scrapers_are_refused_saying_what_is_wrong(text: str, says: str):
    with pytest.raises(ValueError, match=says):
        scrapers_from(text)


def test_the_operator_with_bad_scrapers_exits_at_once_in_one_line(tmp_path: Path) -> None:
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: c\n"
        "clusters: [{name: c, cluster: {server: 'http://127.0.0.1:9'}}]\n"
        "users: [{name: u, user: {token: t}}]\n"
        "contexts: [{name: c, context: {cluster: c, user: u}}]\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("KUBERNETES_")}
    env.update(KUBECONFIG=str(kubeconfig), HOME=str(tmp_path), **{SCRAPERS_ENV: "{nope"})
    done = subprocess.run(
        [sys.executable, "-m", "kvfence_cli", "operator", "--standalone"],
        capture_output=True,
        text=True,
        timeout=FACT_S,  # a hang guard
        env=env,
    )
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"kvfence operator: {SCRAPERS_ENV} is not JSON")
