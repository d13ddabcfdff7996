{{/*
Names, labels and the values every role template shares. The role constants below mirror
services/ops/topology.py (HTTP ports) and services/ops/launcher.py (STOP_MARGIN_S);
tests/compose/test_helm_chart.py fails when they drift apart.
*/}}

{{- define "pdmesh.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "pdmesh.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "pdmesh.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Selector labels of one component: (dict "root" $ "component" "decode") */}}
{{- define "pdmesh.selectorLabels" -}}
app.kubernetes.io/name: {{ include "pdmesh.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "pdmesh.labels" -}}
helm.sh/chart: {{ include "pdmesh.chart" .root }}
{{ include "pdmesh.selectorLabels" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/part-of: pdmesh
{{- end }}

{{- define "pdmesh.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "pdmesh.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "pdmesh.image" -}}
{{- printf "%s:%s" .Values.image.repository (toString .Values.image.tag) }}
{{- end }}

{{/* The role's HTTP port (/health, /ready, /metrics; the gateway: its API), as topology's. */}}
{{- define "pdmesh.httpPort" -}}
{{- get (dict "admission" "8101" "prefill" "8102" "decode" "8103" "gateway" "8000") . }}
{{- end }}

{{/* The gateway's metrics port: its API port + 100 (topology.METRICS_PORT_OFFSET). */}}
{{- define "pdmesh.gatewayMetricsPort" -}}8100{{- end }}

{{/* What a service gets after its drain timeout before SIGKILL (launcher.STOP_MARGIN_S). */}}
{{- define "pdmesh.stopMarginSeconds" -}}10{{- end }}

{{/* A role's drain timeout in seconds: (dict "root" $ "role" "decode") */}}
{{- define "pdmesh.drainTimeout" -}}
{{- $v := index .root.Values .role }}
{{- $d := coalesce $v.drainTimeoutSeconds .root.Values.drainTimeoutSeconds }}
{{- if le (float64 $d) 0.0 }}
{{- fail (printf "%s: the drain timeout must be > 0 (PDMESH_DRAIN_TIMEOUT_S), not %v" .role $d) }}
{{- end }}
{{- toString $d }}
{{- end }}

{{/* terminationGracePeriodSeconds: the drain timeout + the stop margin (+ the gateway's
preStop sleep, which runs before the SIGTERM that starts the drain), as compose's
stop_grace_period. */}}
{{- define "pdmesh.terminationGrace" -}}
{{- $grace := addf (include "pdmesh.drainTimeout" .) (include "pdmesh.stopMarginSeconds" .) }}
{{- if eq .role "gateway" }}
{{- $grace = addf $grace (.root.Values.gateway.preStopSleepSeconds | default 0) }}
{{- end }}
{{- ceil $grace | int }}
{{- end }}

{{/* NATS: the StatefulSet (and its headless Service, which gives each node its DNS name). */}}
{{- define "pdmesh.nats.name" -}}
{{- printf "%s-nats" (include "pdmesh.fullname" .) }}
{{- end }}

{{/* The NATS nodes' DNS names, comma-separated: what clients dial, what the routes of
nats-cluster.conf name and what the server certificate covers (`pdmesh secrets --hosts`). */}}
{{- define "pdmesh.nats.hosts" -}}
{{- $name := include "pdmesh.nats.name" . }}
{{- $hosts := list }}
{{- range $i := until (int .Values.nats.replicas) }}
{{- $hosts = append $hosts (printf "%s-%d.%s.%s.svc" $name $i $name $.Release.Namespace) }}
{{- end }}
{{- join "," $hosts }}
{{- end }}

{{/* PDMESH_NATS_URL: every node (the client fails over between them). */}}
{{- define "pdmesh.nats.url" -}}
{{- $scheme := ternary "tls" "nats" .Values.nats.tls.enabled }}
{{- $urls := list }}
{{- range $host := splitList "," (include "pdmesh.nats.hosts" .) }}
{{- $urls = append $urls (printf "%s://%s:4222" $scheme $host) }}
{{- end }}
{{- join "," $urls }}
{{- end }}

{{/* The OTLP traces endpoint: the value given, else the chart's Jaeger when it runs. */}}
{{- define "pdmesh.otlpEndpoint" -}}
{{- if .Values.tracing.otlpTracesEndpoint }}
{{- .Values.tracing.otlpTracesEndpoint }}
{{- else if .Values.tracing.jaeger.enabled }}
{{- printf "http://%s-jaeger:4318/v1/traces" (include "pdmesh.fullname" .) }}
{{- end }}
{{- end }}

{{/* A number as a setting: whole numbers without a fraction or an exponent (a value of
1048576 is 1048576, never 1.048576e+06, which an int setting refuses). */}}
{{- define "pdmesh.number" -}}
{{- $f := float64 . }}
{{- if eq $f (floor $f) }}{{ int64 $f }}{{ else }}{{ $f }}{{ end }}
{{- end }}

{{/* The KV tiers' settings: set from kvTiers (prefill pods only), never from settings. */}}
{{- define "pdmesh.kvTiers.envNames" -}}
PDMESH_KV_HOST_TOKENS PDMESH_KV_DISK_DIR PDMESH_KV_DISK_GIB PDMESH_KV_REMOTE_URL PDMESH_KV_REMOTE_TTL_S PDMESH_KV_REMOTE_TIMEOUT_S
{{- end }}

{{/* The KV store: Deployment, Service and PVC name. */}}
{{- define "pdmesh.kvStore.name" -}}
{{- printf "%s-kvstore" (include "pdmesh.fullname" .) }}
{{- end }}

{{/* Whether the chart runs the store ("true" or ""): enabled, and no externalUrl. */}}
{{- define "pdmesh.kvStore.deployed" -}}
{{- $s := .Values.kvTiers.store }}
{{- if and $s.enabled (not $s.externalUrl) }}true{{ end }}
{{- end }}

{{/* PDMESH_KV_REMOTE_URL: the externalUrl, else the chart's store, else nothing. */}}
{{- define "pdmesh.kvStore.url" -}}
{{- if .Values.kvTiers.store.externalUrl }}
{{- .Values.kvTiers.store.externalUrl }}
{{- else if include "pdmesh.kvStore.deployed" . }}
{{- printf "redis://%s:6379/0" (include "pdmesh.kvStore.name" .) }}
{{- end }}
{{- end }}

{{/* The disk tier's volume size: kvTiers.disk.sizeLimit, else sizeGiB + 10 % in MiB. */}}
{{- define "pdmesh.kvDisk.size" -}}
{{- $d := .Values.kvTiers.disk }}
{{- if $d.sizeLimit }}
{{- $d.sizeLimit }}
{{- else }}
{{- printf "%dMi" (ceil (mulf $d.sizeGiB 1024 1.1) | int64) }}
{{- end }}
{{- end }}

{{/* Whether KEDA scales this role ("true" or ""): (dict "root" $ "role" "decode") */}}
{{- define "pdmesh.kedaScales" -}}
{{- $k := .root.Values.autoscaling.keda }}
{{- if and $k.enabled (hasKey $k .role) }}
{{- if (index $k .role).enabled }}true{{ end }}
{{- end }}
{{- end }}

{{/* The role's container environment: (dict "root" $ "role" "decode"). The same PDMESH_*
settings as the role's compose service; tests/compose/test_helm_chart.py compares them. */}}
{{- define "pdmesh.env" -}}
{{- $root := .root }}
{{- $role := .role }}
{{- $values := index $root.Values $role }}
{{- $worker := has $role (list "prefill" "decode") }}
{{- $env := list }}
{{- $env = append $env (dict "name" "PDMESH_NATS_URL" "value" (include "pdmesh.nats.url" $root)) }}
{{- if $root.Values.nats.tls.enabled }}
{{- $env = append $env (dict "name" "PDMESH_NATS_TLS_CA" "value" "/run/secrets/nats-ca.crt") }}
{{- end }}
{{- $env = append $env (dict "name" "PDMESH_MODEL" "value" (toString $root.Values.model.name)) }}
{{- $env = append $env (dict "name" "PDMESH_TRANSPORT" "value" $root.Values.transport) }}
{{- if and $worker $root.Values.workers.hostNetwork }}
{{- /* The node's own address: probes reach it, other hosts' pods do too. */}}
{{- $env = append $env (dict "name" "PDMESH_HTTP_HOST" "valueFrom" (dict "fieldRef" (dict "fieldPath" "status.podIP"))) }}
{{- else }}
{{- $env = append $env (dict "name" "PDMESH_HTTP_HOST" "value" "0.0.0.0") }}
{{- end }}
{{- $env = append $env (dict "name" "PDMESH_LOG_LEVEL" "value" (toString $root.Values.logLevel)) }}
{{- if $worker }}
{{- $env = append $env (dict "name" "PDMESH_DATA_HOST" "value" "0.0.0.0") }}
{{- $env = append $env (dict "name" "PDMESH_DATA_PORT" "value" (toString $values.dataPort)) }}
{{- $env = append $env (dict "name" "PDMESH_ADVERTISE_HOST" "valueFrom" (dict "fieldRef" (dict "fieldPath" "status.podIP"))) }}
{{- end }}
{{- if eq $role "gateway" }}
{{- $env = append $env (dict "name" "PDMESH_TENANTS_FILE" "value" "/run/secrets/tenants.toml") }}
{{- $env = append $env (dict "name" "PDMESH_METRICS_HOST" "value" "0.0.0.0") }}
{{- $env = append $env (dict "name" "PDMESH_GATEWAY_PORT" "value" (include "pdmesh.httpPort" $role)) }}
{{- $env = append $env (dict "name" "PDMESH_METRICS_PORT" "value" (include "pdmesh.gatewayMetricsPort" $root)) }}
{{- else }}
{{- $env = append $env (dict "name" "PDMESH_HTTP_PORT" "value" (include "pdmesh.httpPort" $role)) }}
{{- end }}
{{- $env = append $env (dict "name" "PDMESH_WORKER_ID" "valueFrom" (dict "fieldRef" (dict "fieldPath" "metadata.name"))) }}
{{- $env = append $env (dict "name" "PDMESH_DRAIN_TIMEOUT_S" "value" (include "pdmesh.drainTimeout" .)) }}
{{- if and $root.Values.model.cache.enabled (ne $role "admission") }}
{{- $env = append $env (dict "name" "PDMESH_CACHE_DIR" "value" $root.Values.model.cache.mountPath) }}
{{- end }}
{{- if eq $role "prefill" }}
{{- $kv := $root.Values.kvTiers }}
{{- if not (kindIs "invalid" $kv.hostTokens) }}
{{- $env = append $env (dict "name" "PDMESH_KV_HOST_TOKENS" "value" (include "pdmesh.number" $kv.hostTokens)) }}
{{- end }}
{{- if $kv.disk.enabled }}
{{- $env = append $env (dict "name" "PDMESH_KV_DISK_DIR" "value" $kv.disk.mountPath) }}
{{- $env = append $env (dict "name" "PDMESH_KV_DISK_GIB" "value" (include "pdmesh.number" $kv.disk.sizeGiB)) }}
{{- end }}
{{- with include "pdmesh.kvStore.url" $root }}
{{- $env = append $env (dict "name" "PDMESH_KV_REMOTE_URL" "value" .) }}
{{- if not (kindIs "invalid" $kv.store.ttlS) }}
{{- $env = append $env (dict "name" "PDMESH_KV_REMOTE_TTL_S" "value" (include "pdmesh.number" $kv.store.ttlS)) }}
{{- end }}
{{- if not (kindIs "invalid" $kv.store.timeoutS) }}
{{- $env = append $env (dict "name" "PDMESH_KV_REMOTE_TIMEOUT_S" "value" (include "pdmesh.number" $kv.store.timeoutS)) }}
{{- end }}
{{- end }}
{{- end }}
{{- with include "pdmesh.otlpEndpoint" $root }}
{{- $env = append $env (dict "name" "PDMESH_OTLP_TRACES_ENDPOINT" "value" .) }}
{{- end }}
{{- if and $worker (ne $root.Values.transport "tcp") }}
{{- $env = append $env (dict "name" "PDMESH_UCX_ERROR_MODE" "value" $root.Values.ucx.errorMode) }}
{{- range $k, $v := $root.Values.ucx.env }}
{{- $env = append $env (dict "name" $k "value" (toString $v)) }}
{{- end }}
{{- end }}
{{- $managed := list }}
{{- range $env }}{{ $managed = append $managed .name }}{{ end }}
{{- range $k, $v := $values.settings }}
{{- if not (hasPrefix "PDMESH_" $k) }}
{{- fail (printf "%s.settings.%s: settings are PDMESH_* variables (others: %s.extraEnv)" $role $k $role) }}
{{- end }}
{{- if has $k (splitList " " (include "pdmesh.kvTiers.envNames" $root)) }}
{{- fail (printf "%s.settings.%s: the KV tiers are kvTiers values (prefill pods only)" $role $k) }}
{{- end }}
{{- if has $k $managed }}
{{- fail (printf "%s.settings.%s: the chart sets it (from its own values)" $role $k) }}
{{- end }}
{{- $env = append $env (dict "name" $k "value" (toString $v)) }}
{{- end }}
{{- toYaml $env }}
{{- with $values.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end }}
