{{/* Chart name (nameOverride wins). */}}
{{- define "pdserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Resource name prefix: the release name, plus the chart name unless it already contains it. */}}
{{- define "pdserve.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* Labels on everything the chart renders. */}}
{{- define "pdserve.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ include "pdserve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{/* Labels the operator Deployment selects its pods by. */}}
{{- define "pdserve.operatorSelector" -}}
app.kubernetes.io/name: {{ include "pdserve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{/* The operator's ServiceAccount name. */}}
{{- define "pdserve.serviceAccountName" -}}
{{- default (printf "%s-operator" (include "pdserve.fullname" .)) .Values.serviceAccount.name -}}
{{- end -}}

{{/* The image reference (tag defaults to appVersion). */}}
{{- define "pdserve.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/* The CUDA image reference (repository defaults to image.repository + "-cuda", tag to image.tag). */}}
{{- define "pdserve.cudaImage" -}}
{{- $cuda := .Values.image.cuda | default dict -}}
{{- printf "%s:%s" (default (printf "%s-cuda" .Values.image.repository) $cuda.repository) (default (default .Chart.AppVersion .Values.image.tag) $cuda.tag) -}}
{{- end -}}

{{/* Whether kopf peering is on (explicitly, or because there is more than one replica). */}}
{{- define "pdserve.peering" -}}
{{- if or .Values.operator.peering.enabled (gt (int .Values.operator.replicas) 1) -}}true{{- end -}}
{{- end -}}

{{/*
The operator's permissions, the same whether granted cluster-wide (ClusterRole) or per
watched namespace (Role). Nothing beyond what reconciling needs: it reads InferenceServices
and writes only their status; it owns pools, Deployments, Services, the prefill pods'
ServiceAccount/Role/RoleBinding, NetworkPolicies and PodDisruptionBudgets. It holds
endpointslices/services read because RBAC only lets it grant (to prefill pods) what it holds itself.
*/}}
{{/* The operator's --tls mode: off, self-signed or cert-manager (tls.issuer auto: cert-manager when its API is
installed). */}}
{{- define "pdserve.tlsMode" -}}
{{- if not .Values.tls.enabled -}}off
{{- else if eq .Values.tls.issuer "cert-manager" -}}cert-manager
{{- else if eq .Values.tls.issuer "operator" -}}self-signed
{{- else if .Capabilities.APIVersions.Has "cert-manager.io/v1/Certificate" -}}cert-manager
{{- else -}}self-signed
{{- end -}}
{{- end -}}

{{- define "pdserve.operatorRules" -}}
- apiGroups: ["pdserve.io"]
  resources: ["inferenceservices"]
  verbs: ["get", "list", "watch", "patch"]
- apiGroups: ["pdserve.io"]
  resources: ["prefillpools", "decodepools"]
  verbs: ["get", "list", "watch", "create", "patch", "update", "delete"]
- apiGroups: ["pdserve.io"]
  resources: ["inferenceservices/status", "prefillpools/status", "decodepools/status"]
  verbs: ["get", "patch", "update"]
- apiGroups: ["pdserve.io"]
  resources: ["inferenceservices/finalizers", "prefillpools/finalizers", "decodepools/finalizers"]
  verbs: ["update"]
# Autoscaling (spec.autoscaling): replicas through the pools' scale subresource, and the
# pod-deletion-cost annotation on a pool's pods before a scale-down (least loaded goes first).
# Pods are watched too: why a pool's pods do not run (image pull, scheduling, crashes) is its
# Degraded condition, and a Warning Event on it and its InferenceService.
- apiGroups: ["pdserve.io"]
  resources: ["prefillpools/scale", "decodepools/scale"]
  verbs: ["get", "patch", "update"]
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["get", "list", "watch", "patch"]
- apiGroups: ["apps"]
  resources: ["deployments"]
  verbs: ["get", "list", "watch", "create", "patch", "update", "delete"]
- apiGroups: [""]
  resources: ["services", "serviceaccounts"]
  verbs: ["get", "list", "watch", "create", "patch", "update", "delete"]
- apiGroups: ["rbac.authorization.k8s.io"]
  resources: ["roles", "rolebindings"]
  verbs: ["get", "list", "watch", "create", "patch", "update", "delete"]
- apiGroups: ["networking.k8s.io"]
  resources: ["networkpolicies"]
  verbs: ["get", "list", "watch", "create", "patch", "update", "delete"]
# spec.model.cache on a claim: the claim (cache.size) and one download Job per InferenceService;
# the Job's pod may get and patch its own Job (a Role the operator makes, so it holds those verbs).
- apiGroups: [""]
  resources: ["persistentvolumeclaims"]
  verbs: ["get", "list", "watch", "create", "patch", "update", "delete"]
- apiGroups: ["batch"]
  resources: ["jobs"]
  verbs: ["get", "list", "watch", "create", "patch", "update", "delete"]
# A PodDisruptionBudget per pool and router (spec.*.disruptionBudget).
- apiGroups: ["policy"]
  resources: ["poddisruptionbudgets"]
  verbs: ["get", "list", "watch", "create", "patch", "update", "delete"]
- apiGroups: ["discovery.k8s.io"]
  resources: ["endpointslices"]
  verbs: ["get", "list", "watch"]
- apiGroups: ["", "events.k8s.io"]
  resources: ["events"]
  verbs: ["create", "patch"]
{{- $tls := include "pdserve.tlsMode" . }}
{{- if ne $tls "off" }}
# Mutual TLS (tls.enabled): each InferenceService's CA and certificate, in Secrets the operator writes
# (self-signed) or reads nothing of (cert-manager writes them from the Certificates below).
- apiGroups: [""]
  resources: ["secrets"]
  verbs: ["get", "create", "patch"]
{{- end }}
{{- if eq $tls "cert-manager" }}
- apiGroups: ["cert-manager.io"]
  resources: ["issuers", "certificates"]
  verbs: ["get", "create", "patch"]
{{- end }}
{{- end -}}
