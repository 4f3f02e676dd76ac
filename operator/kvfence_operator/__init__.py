"""kvfence operator: the InferenceDeployment API, its CRD and the pure builders of its children.

Importing this package must stay cheap (no kopf, no kubernetes client): `kvfence crd` and the
tests use it without a cluster.
"""
