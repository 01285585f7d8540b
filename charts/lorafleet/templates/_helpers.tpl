{{/* The release's full name, at most 63 characters. */}}
{{- define "lorafleet.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "lorafleet.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Selector labels: stable for the life of the release. */}}
{{- define "lorafleet.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{- define "lorafleet.labels" -}}
helm.sh/chart: {{ include "lorafleet.chart" . }}
{{ include "lorafleet.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: lorafleet
{{- end -}}

{{- define "lorafleet.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "lorafleet.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* The Secret holding the key pools' tokens are derived from. */}}
{{- define "lorafleet.keySecretName" -}}
{{- default (printf "%s-key" (include "lorafleet.fullname" .)) .Values.operator.credentialsKeySecret -}}
{{- end -}}

{{- define "lorafleet.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/* Rules on namespaced objects: what the operator creates for each pool, and reads. */}}
{{- define "lorafleet.namespacedRules" -}}
- apiGroups: [lorafleet.dev]
  resources: [servingpools, loraadapters]
  verbs: [get, list, watch, patch, update]
- apiGroups: [lorafleet.dev]
  resources: [servingpools/status, loraadapters/status]
  verbs: [get, patch, update]
- apiGroups: [lorafleet.dev]
  resources: [servingpools/finalizers, loraadapters/finalizers]
  verbs: [update]
- apiGroups: [apps]
  resources: [deployments]
  verbs: [get, list, watch, create, update, patch, delete]
- apiGroups: [apps]
  resources: [deployments/scale]
  verbs: [get, patch, update]
- apiGroups: [""]
  resources: [services, serviceaccounts]
  verbs: [get, list, watch, create, update, patch, delete]
# Each pool's credential Secrets: written (server-side apply) from values derived from the
# operator's key, never read; the garbage collector deletes them with their pool.
- apiGroups: [""]
  resources: [secrets]
  verbs: [create, patch]
# Runner pods: read them, and set the deletion cost of a drained one.
- apiGroups: [""]
  resources: [pods]
  verbs: [get, list, watch, patch]
- apiGroups: [discovery.k8s.io]
  resources: [endpointslices]
  verbs: [get, list, watch]
- apiGroups: [rbac.authorization.k8s.io]
  resources: [roles, rolebindings]
  verbs: [get, list, watch, create, update, patch, delete]
- apiGroups: [networking.k8s.io]
  resources: [ingresses, networkpolicies]
  verbs: [get, list, watch, create, update, patch, delete]
- apiGroups: ["", events.k8s.io]
  resources: [events]
  verbs: [create, patch]
{{- with .Values.rbac.nodeGroupRules }}
{{ toYaml . }}
{{- end }}
{{- end -}}
