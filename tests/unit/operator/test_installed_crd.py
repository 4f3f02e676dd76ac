"""Issue 26 item 7: the installed CRD is checked against this operator's (crd/installed.py,
cluster/crd_check.py). An older one, left by `helm upgrade` (Helm never upgrades CRDs), lacks
status fields the API server would then prune from every write."""

import copy
from typing import Any

import kmock

from kvfence_devcluster.discovery import Entry
from kvfence_devcluster.openapi import document
from kvfence_operator.cluster.crd_check import CrdCheck
from kvfence_operator.cluster.kube import KubeError
from kvfence_operator.crd.installed import (
    OPENAPI_PATH,
    built_schema,
    field_paths,
    missing_fields,
    published_schema,
)
from kvfence_operator.crd.schema import build_crd


def older_crd() -> dict[str, Any]:
    """This CRD as an earlier release had it: no status.progress, no revision.retiring."""
    crd = build_crd()
    status = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]
    del status["properties"]["progress"]
    del status["properties"]["revision"]["properties"]["retiring"]
    return crd


def published(crd: dict[str, Any]) -> dict[str, Any]:
    """The group-version's OpenAPI v3 document as the emulated API server publishes it."""
    version = crd["spec"]["versions"][0]
    resource = kmock.resource(crd["spec"]["group"], version["name"], crd["spec"]["names"]["plural"])
    info = kmock.ResourceInfo(kind=crd["spec"]["names"]["kind"], namespaced=True)
    entries: list[Entry] = [(resource, info, {"status"})]
    key = (crd["spec"]["group"], version["name"], crd["spec"]["names"]["plural"])
    schemas = {key: version["schema"]["openAPIV3Schema"]}
    found = document(entries, crd["spec"]["group"], version["name"], schemas)
    assert found is not None
    return found


def test_field_paths_walk_objects_lists_and_maps():
    schema = {"properties": {"a": {"properties": {"b": {}}},
                             "l": {"items": {"properties": {"c": {}}}},
                             "m": {"additionalProperties": {"properties": {"d": {}}}}}}  # fmt: skip
    assert field_paths(schema) == {"a", "a.b", "l", "l[].c", "m", "m.*.d"}


def test_the_operators_own_crd_as_published_holds_every_field():
    assert missing_fields(published_schema(published(build_crd()))) == []
    assert len(field_paths(built_schema())) > 100


def test_an_older_crd_lacks_the_status_fields_the_server_would_prune():
    missing = missing_fields(published_schema(published(older_crd())))
    assert "status.progress" in missing and "status.revision.retiring" in missing
    assert not [m for m in missing if m.startswith("spec")]


def test_a_newer_crd_with_more_fields_is_accepted():
    crd = build_crd()
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    spec["properties"]["future"] = {"type": "string"}
    assert missing_fields(published_schema(published(crd))) == []


class Documents:
    def __init__(self, *answers: Any) -> None:
        self.answers, self.reads = list(answers), 0

    def document(self, path: str) -> Any:
        assert path == OPENAPI_PATH
        self.reads += 1
        answer = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        if isinstance(answer, Exception):
            raise answer
        return copy.deepcopy(answer)


def test_the_check_reads_again_while_outdated_and_never_once_current():
    now = [0.0]
    documents = Documents(published(older_crd()), published(build_crd()))
    check = CrdCheck(documents, recheck_seconds=15, clock=lambda: now[0])
    message = check.outdated()
    assert message is not None and "status.progress" in message and "kubectl apply" in message
    now[0] = 10
    assert check.outdated() == message and documents.reads == 1  # not read again yet
    now[0] = 16
    assert check.outdated() is None and documents.reads == 2  # the CRD was upgraded
    now[0] = 1000
    assert check.outdated() is None and documents.reads == 2


def test_a_cluster_that_publishes_no_document_or_refuses_is_not_refused():
    assert CrdCheck(Documents(None)).outdated() is None
    assert CrdCheck(Documents(KubeError(403, "GET", OPENAPI_PATH, "forbidden"))).outdated() is None
