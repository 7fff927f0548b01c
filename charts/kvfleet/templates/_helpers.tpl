{{- define "kvfleet.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "kvfleet.labels" -}}
app.kubernetes.io/name: kvfleet
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "kvfleet.selectorLabels" -}}
app.kubernetes.io/name: kvfleet
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{/* An image of the chart's (a repository and tag) under imageRegistry, when one is set. */}}
{{- define "kvfleet.image" -}}
{{- $registry := trimSuffix "/" .root.Values.imageRegistry -}}
{{- if $registry -}}{{ $registry }}/{{ end -}}{{ .image }}
{{- end -}}

{{/* The tiers' PriorityClasses are <prefix>-<tier>: the release's name unless priorityClasses.namePrefix is set. */}}
{{- define "kvfleet.priorityClassPrefix" -}}
{{- .Values.priorityClasses.namePrefix | default .Release.Name -}}
{{- end -}}

{{- define "kvfleet.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "kvfleet.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* The rules the operator needs in every namespace it watches. */}}
{{- define "kvfleet.namespacedRules" -}}
- apiGroups: ["kvfleet.dev"]
  resources: ["inferenceservices"]
  verbs: ["get", "list", "watch", "patch"]
- apiGroups: ["kvfleet.dev"]
  resources: ["inferenceservices/status"]
  verbs: ["patch"]
# Owner references that block deletion need this on the owner.
- apiGroups: ["kvfleet.dev"]
  resources: ["inferenceservices/finalizers"]
  verbs: ["update"]
# deletecollection: a model that spans nodes starts a group on a new template by deleting its pods together.
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["list", "watch", "deletecollection"]
# get, on every kind of child: before applying one, the operator reads the object of that name, if any, and
# applies only when the InferenceService is its controller (it never takes over another object).
# delete: groups above the desired count, and the workload of another shape after the spec changed shape
# (one pod per replica, a StatefulSet per group, a LeaderWorkerSet, a Deployment per disaggregated role).
- apiGroups: ["apps"]
  resources: ["deployments", "statefulsets"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: ["leaderworkerset.x-k8s.io"]
  resources: ["leaderworkersets"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: [""]
  resources: ["services"]
  verbs: ["get", "create", "patch"]
# The Secrets an InferenceService names: their labels (only those labelled kvfleet.dev/secret=true may be
# used), and the API key (spec.engine.apiKeySecret) with which it loads LoRA adapters into the replicas.
# Only get, never list or watch: it reads no Secret no InferenceService names.
- apiGroups: [""]
  resources: ["secrets"]
  verbs: ["get"]
# The Batch API's store (spec.batch).
- apiGroups: [""]
  resources: ["persistentvolumeclaims"]
  verbs: ["get", "create", "patch"]
- apiGroups: ["policy"]
  resources: ["poddisruptionbudgets"]
  verbs: ["get", "create", "patch"]
- apiGroups: ["monitoring.coreos.com"]
  resources: ["servicemonitors"]
  verbs: ["get", "create", "patch"]
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create"]
{{- end -}}

{{- define "kvfleet.gatewayLabels" -}}
app.kubernetes.io/name: kvfleet
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: gateway
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "kvfleet.gatewaySelectorLabels" -}}
app.kubernetes.io/name: kvfleet
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: gateway
{{- end -}}
