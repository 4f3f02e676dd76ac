"""The revision: a short, stable hash of the spec parts that change pods.

A new revision means new prefill, decode and router Deployments and a canary before promotion;
changing anything else (replica counts, minContextLength, the Service, canary settings) is
applied in place to the current revision.
"""

import hashlib
import json

from kvfence_operator.crd.types import InferenceDeploymentSpec

REVISION_LENGTH = 10


def pod_shaping_parts(spec: InferenceDeploymentSpec) -> dict[str, object]:
    dump = spec.model_dump(mode="json", by_alias=True, exclude_none=True)
    return {
        "model": dump["model"],
        "engine": dump["engine"],
        "contextLength": dump["contextLength"],
        "poolPolicy": dump["poolPolicy"],
        "prefill": {k: v for k, v in dump["prefill"].items() if k != "replicas"},
        "decode": {k: v for k, v in dump["decode"].items() if k != "replicas"},
        "router": {"apiKeysSecret": dump["router"]["apiKeysSecret"]},
        # the router's and the engines' flags; absent while unset (older revisions' hashes)
        **({"tenantLimits": dump["tenantLimits"]} if dump["tenantLimits"] else {}),
    }


def revision_of(spec: InferenceDeploymentSpec) -> str:
    """exclude_none keeps hashes stable when a later version adds an optional field."""
    canonical = json.dumps(pod_shaping_parts(spec), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:REVISION_LENGTH]
