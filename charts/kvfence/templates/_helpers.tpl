{{/*
Name of the operator's Deployment, ServiceAccount and RBAC objects.
*/}}
{{- define "kvfence.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else if contains "kvfence" .Release.Name -}}
{{- printf "%s-operator" .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-kvfence-operator" .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{/*
Cluster-scoped objects carry the release namespace: two releases of the same name in two
namespaces must not share (and overwrite) one ClusterRole.
*/}}
{{- define "kvfence.clusterScopedName" -}}
{{- printf "%s-%s" .Release.Namespace (include "kvfence.fullname" .) | trunc 253 | trimSuffix "-" -}}
{{- end -}}

{{- define "kvfence.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "kvfence.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/*
Selector labels. app.kubernetes.io/name: kvfence-operator is the label the engines'
NetworkPolicies admit (OPERATOR_POD_LABELS in kvfence_operator/meta.py): without it the
operator cannot read the engines' /v1/kvpool and no pod ever passes the pool check.
*/}}
{{- define "kvfence.selectorLabels" -}}
app.kubernetes.io/name: kvfence-operator
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "kvfence.labels" -}}
{{ include "kvfence.selectorLabels" . }}
app.kubernetes.io/component: operator
app.kubernetes.io/part-of: kvfence
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end -}}

{{/*
The leader Lease, in the release namespace.
*/}}
{{- define "kvfence.leaseName" -}}
{{- default (include "kvfence.fullname" .) .Values.leaderElection.leaseName -}}
{{- end -}}

{{- define "kvfence.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/*
RBAC rules, each commented as "framework" (what kopf itself needs) or "application" (what
kvfence's handlers do). Every kind here is namespaced: the same rules go into a ClusterRole
(all namespaces) or into a Role in each watched namespace. kopf needs nothing cluster-scoped:
no peering objects (kopf peering is off: --standalone or --leader-elect; the leader Lease is
in leader-election.yaml), and no CRD or namespace watching, because
the operator's startup disables kopf's scanning (namespaces come from the command line, the
InferenceDeployment resource from API discovery, which every authenticated client may read).
*/}}
{{- define "kvfence.rules" -}}
# framework: kopf posts events about its handlers' progress and errors.
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create"]
# application: InferenceDeployments are watched; the patch writes kopf's annotations (handler
# progress lives in kvfence.dev/ annotations) and removes the kvfence.dev/finalizer that
# older operators set (this one sets none, so an uninstall leaves nothing in Terminating).
- apiGroups: ["kvfence.dev"]
  resources: ["inferencedeployments"]
  verbs: ["get", "list", "watch", "patch"]
# application: conditions, pools, revisions and the canary's result go to status.
- apiGroups: ["kvfence.dev"]
  resources: ["inferencedeployments/status"]
  verbs: ["get", "patch"]
# application: every child's ownerReference sets blockOwnerDeletion, which the
# OwnerReferencesPermissionEnforcement admission plugin (OpenShift, hardened clusters) allows
# only to whom may update the owner's finalizers; without this rule every create is refused.
- apiGroups: ["kvfence.dev"]
  resources: ["inferencedeployments/finalizers"]
  verbs: ["update"]
# application: prefill, decode and router Deployments of each revision.
- apiGroups: ["apps"]
  resources: ["deployments"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
# application: a pod's ReplicaSet, read by name to check that the revision's Deployment
# controls the pod (pod -> ReplicaSet -> Deployment) before it gets the internal token;
# listed and watched (by the kvfence label) to fill the operator's cache.
- apiGroups: ["apps"]
  resources: ["replicasets"]
  verbs: ["get", "list", "watch"]
# application: engine headless Services, the revision and stable router Services, and the
# routers' backend ConfigMaps.
- apiGroups: [""]
  resources: ["services", "configmaps"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
# application: Secrets, by name only (no list or watch: the operator cannot enumerate
# them), and only in the watched namespaces when watchNamespaces is set (a Role in each).
# create: each revision's Secret (its credentials, derived from the credentials key, so never
# read back), and a dry run of the user's apiKeysSecret (a 409 says it exists:
# ApiKeysSecretMissing otherwise); delete: a retired revision's. No get: the operator reads
# no Secret here. get only with rbac.legacyRevisionSecrets, for revisions an older operator
# made with random credentials. No patch or update: a revision's Secret is immutable, the
# user's is never written.
- apiGroups: [""]
  resources: ["secrets"]
  verbs: [{{ if .Values.rbac.legacyRevisionSecrets }}"get", {{ end }}"create", "delete"]
# application: engine pods are found to read their /v1/kvpool; canary pods for the verdict.
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["get", "list", "watch"]
# application: the kvfence.dev/kv-pool readiness-gate condition on each engine pod.
- apiGroups: [""]
  resources: ["pods/status"]
  verbs: ["patch"]
# application: the isolation canary Job that gates each rollout.
- apiGroups: ["batch"]
  resources: ["jobs"]
  verbs: ["get", "list", "watch", "create", "delete"]
# application: NetworkPolicies that let only a revision's routers (and this operator) reach
# its engines, only its prefill pods reach decode's transfer port, and only its canary (and
# this operator) reach its routers until it serves; patched back when someone edits them.
- apiGroups: ["networking.k8s.io"]
  resources: ["networkpolicies"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
# application: PodDisruptionBudgets that let a voluntary disruption take one pod of a
# revision's role at a time; patched back when someone edits them (drift repair), retired
# with the revision.
- apiGroups: ["policy"]
  resources: ["poddisruptionbudgets"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
{{- end -}}

{{/*
prometheusRule.alertLabels, for each alert's labels beside its severity.
*/}}
{{- define "kvfence.alertLabels" -}}
{{- with .Values.prometheusRule.alertLabels }}{{ toYaml . }}{{ end -}}
{{- end -}}
