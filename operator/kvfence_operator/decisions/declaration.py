"""What a revision's Deployments were built as, recorded on them, so that an operator upgrade
rolls nothing (issue 26 item 6).

Each pass declares a kept revision's children with this release's builders (drift.py keeps
them so). Across an upgrade whose builders write a Deployment differently (a new flag, a new
probe), that would patch every kept revision's Deployments at once and replace every pod: no
new revision, no canary, no pacing. So each Deployment carries what it was built as
(meta.ANNOTATION_DECLARED: its declared fields but the replica count, compressed, sealed with an
HMAC of the operator's credentials key over the InferenceDeployment and the revision). A pass
declares it from that record while the record verifies and differs from this release's output:
it is kept as the release that made it built it (a `kubectl set image` is still put back, to
the recorded image), and this release's builders reach a revision only through a new one (a
spec change: a canary and a paced rollout). A record that does not verify (edited, or sealed
under another key) is ignored: the Deployment is declared by this release's builders and
recorded anew. Without a credentials key nothing is recorded (as before). Deployments made
before records existed are declared by this release's builders once, then recorded.
"""

import base64
import copy
import hashlib
import hmac
import json
import zlib
from collections.abc import Mapping
from typing import Any

from kvfence_operator.decisions.drift import declared_fields
from kvfence_operator.meta import ANNOTATION_DECLARED, Instance

PURPOSE = "kvfence declared deployment v1"


def _declaration(deployment: Mapping[str, Any]) -> dict[str, Any]:
    """What the builders declare of `deployment`, less the record itself and the replicas (the
    object's counts, which change without a new revision)."""
    declared = copy.deepcopy(declared_fields(deployment))
    annotations = (declared.get("metadata") or {}).get("annotations") or {}
    annotations.pop(ANNOTATION_DECLARED, None)
    (declared.get("spec") or {}).pop("replicas", None)
    return declared


def _seal(key: bytes, instance: Instance, revision: str, payload: str) -> str:
    message = "\0".join(
        (PURPOSE, instance.namespace, instance.name, instance.uid, revision, payload)
    )
    digest = hmac.new(key, message.encode(), hashlib.sha256).digest()
    return base64.urlsafe_b64encode(digest).decode().rstrip("=")


def record(key: bytes, instance: Instance, revision: str, deployment: Mapping[str, Any]) -> str:
    """The ANNOTATION_DECLARED value for `deployment` as built: `<seal>.<payload>`."""
    text = json.dumps(_declaration(deployment), sort_keys=True, separators=(",", ":"))
    payload = base64.urlsafe_b64encode(zlib.compress(text.encode(), 9)).decode()
    return f"{_seal(key, instance, revision, payload)}.{payload}"


def recorded(key: bytes, instance: Instance, revision: str, value: object) -> dict[str, Any] | None:
    """The declaration a record holds, if it is this operator's for this revision."""
    seal, dot, payload = str(value or "").partition(".")
    if not dot or not hmac.compare_digest(seal, _seal(key, instance, revision, payload)):
        return None
    try:
        found = json.loads(zlib.decompress(base64.urlsafe_b64decode(payload.encode())))
    except (ValueError, zlib.error):
        return None
    return found if isinstance(found, dict) else None


def declared_as(
    built: Mapping[str, Any],
    live: Mapping[str, Any] | None,
    key: bytes | None,
    instance: Instance,
    revision: str,
) -> dict[str, Any]:
    """The Deployment a pass keeps `live` as: what a verified record on it says, when this
    release's builders (`built`) would write it differently; else `built`, recorded. Replicas
    and ownerReferences are always `built`'s."""
    child = copy.deepcopy(dict(built))
    if key is None:
        return child
    annotations = ((live or {}).get("metadata") or {}).get("annotations") or {}
    earlier = recorded(key, instance, revision, annotations.get(ANNOTATION_DECLARED))
    if earlier is None or earlier == _declaration(built):
        child["metadata"].setdefault("annotations", {})[ANNOTATION_DECLARED] = record(
            key, instance, revision, built
        )
        return child
    kept = copy.deepcopy(earlier)
    metadata = kept.pop("metadata", {})
    kept_annotations = dict(metadata.get("annotations") or {})
    kept_annotations[ANNOTATION_DECLARED] = annotations[ANNOTATION_DECLARED]
    kept["spec"]["replicas"] = built["spec"]["replicas"]
    return {
        "apiVersion": built["apiVersion"],
        "kind": built["kind"],
        "metadata": {
            **{k: v for k, v in built["metadata"].items() if k not in ("labels", "annotations")},
            **({"labels": metadata["labels"]} if metadata.get("labels") else {}),
            "annotations": kept_annotations,
        },
        **kept,
    }
