{{/*
One pdmesh role: its Deployment (`pdmesh serve <role>`, as compose runs it), its Service and
its PodDisruptionBudget. Called as (dict "root" $ "role" "decode").
*/}}
{{- define "pdmesh.role" -}}
{{- $root := .root }}
{{- $role := .role }}
{{- $v := index $root.Values $role }}
{{- $full := include "pdmesh.fullname" $root }}
{{- $worker := has $role (list "prefill" "decode") }}
{{- $port := include "pdmesh.httpPort" $role }}
{{- $hostNetwork := and $worker $root.Values.workers.hostNetwork }}
{{- $tls := $root.Values.nats.tls.enabled }}
{{- $cache := and $root.Values.model.cache.enabled (ne $role "admission") }}
{{- $fetch := and $cache (or $root.Values.model.fetch.command (eq (toString $root.Values.model.name) "smollm2")) }}
{{- $tlsSecret := $root.Values.nats.tls.secretName | default $root.Values.secrets.files }}
{{- $kvDisk := and (eq $role "prefill") $root.Values.kvTiers.disk.enabled }}
{{- if and $kvDisk $root.Values.kvTiers.disk.existingClaim (or (gt (int $v.replicas) 1) (include "pdmesh.kedaScales" .)) }}
{{- fail "kvTiers.disk.existingClaim: one claim for every prefill pod, but each worker's disk tier must be a directory of its own: with more than one prefill replica use the emptyDir or kvTiers.disk.ephemeral" }}
{{- end }}
{{- $ctx := dict "root" $root "component" $role }}
apiVersion: apps/v1
kind: Deployment
metadata:
  name: {{ $full }}-{{ $role }}
  labels:
    {{- include "pdmesh.labels" $ctx | nindent 4 }}
spec:
  {{- if not (include "pdmesh.kedaScales" .) }}
  replicas: {{ $v.replicas }}
  {{- end }}
  revisionHistoryLimit: 5
  strategy:
    {{- toYaml ($v.strategy | default $root.Values.strategy) | nindent 4 }}
  selector:
    matchLabels:
      {{- include "pdmesh.selectorLabels" $ctx | nindent 6 }}
  template:
    metadata:
      labels:
        {{- include "pdmesh.labels" $ctx | nindent 8 }}
        {{- with $v.podLabels }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      {{- if or $root.Values.metrics.scrapeAnnotations $v.podAnnotations }}
      annotations:
        {{- if $root.Values.metrics.scrapeAnnotations }}
        prometheus.io/scrape: "true"
        prometheus.io/port: {{ ternary (include "pdmesh.gatewayMetricsPort" $root) $port (eq $role "gateway") | quote }}
        prometheus.io/path: /metrics
        {{- end }}
        {{- with $v.podAnnotations }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      {{- end }}
    spec:
      serviceAccountName: {{ include "pdmesh.serviceAccountName" $root }}
      automountServiceAccountToken: false
      # SIGTERM starts the drain (PDMESH_DRAIN_TIMEOUT_S); SIGKILL only after the hand-off
      # and the NATS flush: the drain timeout + {{ include "pdmesh.stopMarginSeconds" $root }} s.
      terminationGracePeriodSeconds: {{ include "pdmesh.terminationGrace" . }}
      {{- if $hostNetwork }}
      hostNetwork: true
      dnsPolicy: ClusterFirstWithHostNet
      {{- end }}
      {{- with $v.priorityClassName }}
      priorityClassName: {{ . }}
      {{- end }}
      {{- with $root.Values.imagePullSecrets }}
      imagePullSecrets:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      securityContext:
        {{- toYaml $root.Values.podSecurityContext | nindent 8 }}
      {{- if or $root.Values.waitForNats $fetch }}
      initContainers:
        {{- if $root.Values.waitForNats }}
        - name: wait-for-nats
          image: {{ include "pdmesh.image" $root }}
          imagePullPolicy: {{ $root.Values.image.pullPolicy }}
          command:
            - python
            - -c
            - |
              import socket, sys, time
              while True:
                  for host in sys.argv[1:]:
                      try:
                          socket.create_connection((host, 4222), timeout=2).close()
                          sys.exit(0)
                      except OSError:
                          pass
                  print("waiting for NATS on", ", ".join(sys.argv[1:]), flush=True)
                  time.sleep(2)
            {{- range splitList "," (include "pdmesh.nats.hosts" $root) }}
            - {{ . }}
            {{- end }}
          securityContext:
            {{- toYaml $root.Values.securityContext | nindent 12 }}
          resources:
            requests: {cpu: 10m, memory: 32Mi}
        {{- end }}
        {{- if $fetch }}
        # Fills the node's model cache once: a model already there returns at once.
        - name: fetch-model
          {{- with $root.Values.model.fetch.image }}
          image: {{ printf "%s:%s" .repository (toString .tag) }}
          {{- else }}
          image: {{ include "pdmesh.image" $root }}
          {{- end }}
          imagePullPolicy: {{ $root.Values.image.pullPolicy }}
          {{- if $root.Values.model.fetch.command }}
          command:
            {{- toYaml $root.Values.model.fetch.command | nindent 12 }}
          {{- else }}
          command:
            - python
            - -c
            - from pdmesh.services.engine.checkpoint import fetch_smollm2; print(fetch_smollm2())
          {{- end }}
          env:
            - name: PDMESH_CACHE_DIR
              value: {{ $root.Values.model.cache.mountPath }}
            - name: HOME
              value: /tmp
          securityContext:
            runAsUser: {{ $root.Values.model.fetch.runAsUser }}
            runAsNonRoot: {{ ne (int $root.Values.model.fetch.runAsUser) 0 }}
            allowPrivilegeEscalation: false
            capabilities:
              drop: [ALL]
          {{- with $root.Values.model.fetch.resources }}
          resources:
            {{- toYaml . | nindent 12 }}
          {{- end }}
          volumeMounts:
            - name: model-cache
              mountPath: {{ $root.Values.model.cache.mountPath }}
        {{- end }}
      {{- end }}
      containers:
        - name: {{ $role }}
          image: {{ include "pdmesh.image" $root }}
          imagePullPolicy: {{ $root.Values.image.pullPolicy }}
          args: [pdmesh, serve, {{ $role }}]
          env:
            {{- include "pdmesh.env" . | nindent 12 }}
          # This role's NATS user and its one key (`pdmesh secrets`: nats-{{ $role }}.env and
          # {{ get (dict "admission" "signing.env" "prefill" "verify.env" "decode" "verify.env" "gateway" "salt.env") $role }}).
          envFrom:
            - secretRef:
                name: {{ index $root.Values.secrets.env $role }}
          ports:
            - name: http
              containerPort: {{ $port }}
            {{- if eq $role "gateway" }}
            - name: metrics
              containerPort: {{ include "pdmesh.gatewayMetricsPort" $root }}
            {{- end }}
            {{- if $worker }}
            - name: data
              containerPort: {{ $v.dataPort }}
            {{- end }}
          startupProbe:
            httpGet: {path: /health, port: http}
            {{- toYaml $root.Values.probes.startup | nindent 12 }}
          readinessProbe:
            httpGet: {path: /ready, port: http}
            {{- toYaml $root.Values.probes.readiness | nindent 12 }}
          livenessProbe:
            httpGet: {path: /health, port: http}
            {{- toYaml $root.Values.probes.liveness | nindent 12 }}
          {{- if and (eq $role "gateway") (gt (float64 ($v.preStopSleepSeconds | default 0)) 0.0) }}
          lifecycle:
            preStop:
              exec:
                command: [sleep, {{ $v.preStopSleepSeconds | quote }}]
          {{- end }}
          {{- with $v.resources }}
          resources:
            {{- toYaml . | nindent 12 }}
          {{- end }}
          securityContext:
            {{- $sc := deepCopy $root.Values.securityContext }}
            {{- if and $worker $root.Values.workers.ipcLock }}
            {{- $caps := deepCopy ($sc.capabilities | default dict) }}
            {{- $_ := set $caps "add" (list "IPC_LOCK") }}
            {{- $_ := set $sc "capabilities" $caps }}
            {{- end }}
            {{- toYaml $sc | nindent 12 }}
          {{- if or (eq $role "gateway") $tls $cache (and $worker $root.Values.workers.shm.enabled) $kvDisk }}
          volumeMounts:
            {{- if or (eq $role "gateway") $tls }}
            - name: secrets
              mountPath: /run/secrets
              readOnly: true
            {{- end }}
            {{- if $cache }}
            - name: model-cache
              mountPath: {{ $root.Values.model.cache.mountPath }}
              readOnly: true
            {{- end }}
            {{- if and $worker $root.Values.workers.shm.enabled }}
            - name: shm
              mountPath: /dev/shm
            {{- end }}
            {{- if $kvDisk }}
            - name: kv-disk
              mountPath: {{ $root.Values.kvTiers.disk.mountPath }}
            {{- end }}
          {{- end }}
      {{- if or (eq $role "gateway") $tls $cache (and $worker $root.Values.workers.shm.enabled) $kvDisk }}
      volumes:
        {{- if or (eq $role "gateway") $tls }}
        # Only this role's files (tenants.toml: the gateway; the NATS CA with TLS), where
        # compose mounts them.
        - name: secrets
          projected:
            defaultMode: 288   # 0440: the pod's group (fsGroup) reads
            sources:
              {{- if eq $role "gateway" }}
              - secret:
                  name: {{ $root.Values.secrets.files }}
                  items:
                    - {key: tenants.toml, path: tenants.toml}
              {{- end }}
              {{- if $tls }}
              - secret:
                  name: {{ $tlsSecret }}
                  items:
                    - {key: {{ $root.Values.nats.tls.caKey }}, path: nats-ca.crt}
              {{- end }}
        {{- end }}
        {{- if $cache }}
        - name: model-cache
          {{- if $root.Values.model.cache.existingClaim }}
          persistentVolumeClaim:
            claimName: {{ $root.Values.model.cache.existingClaim }}
          {{- else }}
          hostPath:
            path: {{ $root.Values.model.cache.hostPath }}
            type: DirectoryOrCreate
          {{- end }}
        {{- end }}
        {{- if and $worker $root.Values.workers.shm.enabled }}
        - name: shm
          emptyDir:
            medium: Memory
            sizeLimit: {{ $root.Values.workers.shm.sizeLimit }}
        {{- end }}
        {{- if $kvDisk }}
        {{- $disk := $root.Values.kvTiers.disk }}
        # KV tier 2 (PDMESH_KV_DISK_DIR): this worker's own, written as the pod's group (fsGroup).
        - name: kv-disk
          {{- if $disk.existingClaim }}
          persistentVolumeClaim:
            claimName: {{ $disk.existingClaim }}
          {{- else if $disk.ephemeral.enabled }}
          ephemeral:
            volumeClaimTemplate:
              metadata:
                labels:
                  {{- include "pdmesh.labels" $ctx | nindent 18 }}
              spec:
                accessModes: [ReadWriteOnce]
                {{- with $disk.ephemeral.storageClassName }}
                storageClassName: {{ . }}
                {{- end }}
                resources:
                  requests:
                    storage: {{ include "pdmesh.kvDisk.size" $root }}
          {{- else }}
          emptyDir:
            sizeLimit: {{ include "pdmesh.kvDisk.size" $root }}
          {{- end }}
        {{- end }}
      {{- end }}
      {{- with $v.nodeSelector }}
      nodeSelector:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $v.tolerations }}
      tolerations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- if $v.affinity }}
      affinity:
        {{- toYaml $v.affinity | nindent 8 }}
      {{- else if and $worker $root.Values.workers.spreadRoles }}
      # Prefill and decode prefer different nodes (and replicas of one role, each other's).
      affinity:
        podAntiAffinity:
          preferredDuringSchedulingIgnoredDuringExecution:
            - weight: 100
              podAffinityTerm:
                topologyKey: kubernetes.io/hostname
                labelSelector:
                  matchLabels:
                    {{- include "pdmesh.selectorLabels" (dict "root" $root "component" (ternary "decode" "prefill" (eq $role "prefill"))) | nindent 20 }}
            - weight: 50
              podAffinityTerm:
                topologyKey: kubernetes.io/hostname
                labelSelector:
                  matchLabels:
                    {{- include "pdmesh.selectorLabels" $ctx | nindent 20 }}
      {{- end }}
---
{{- if eq $role "gateway" }}
# The API only: the metrics port (per-tenant series) has a Service of its own below, inside
# the cluster, whatever this one's type.
apiVersion: v1
kind: Service
metadata:
  name: {{ $full }}-gateway
  labels:
    {{- include "pdmesh.labels" $ctx | nindent 4 }}
  {{- with $v.service.annotations }}
  annotations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
spec:
  type: {{ $v.service.type }}
  selector:
    {{- include "pdmesh.selectorLabels" $ctx | nindent 4 }}
  ports:
    - name: http
      port: {{ $v.service.port }}
      targetPort: http
---
# Headless: each gateway pod's metrics port (/metrics, and the details of /health, /ready).
apiVersion: v1
kind: Service
metadata:
  name: {{ $full }}-gateway-metrics
  labels:
    {{- include "pdmesh.labels" $ctx | nindent 4 }}
    pdmesh.io/metrics: "true"
spec:
  clusterIP: None
  selector:
    {{- include "pdmesh.selectorLabels" $ctx | nindent 4 }}
  ports:
    - name: metrics
      port: {{ include "pdmesh.gatewayMetricsPort" $root }}
      targetPort: metrics
{{- else }}
# Headless: each pod's /metrics (Prometheus) and /health, /ready; no traffic goes through
# it (admission routes work to workers over NATS; KV goes pod to pod).
apiVersion: v1
kind: Service
metadata:
  name: {{ $full }}-{{ $role }}
  labels:
    {{- include "pdmesh.labels" $ctx | nindent 4 }}
    pdmesh.io/metrics: "true"
spec:
  clusterIP: None
  selector:
    {{- include "pdmesh.selectorLabels" $ctx | nindent 4 }}
  ports:
    - name: metrics
      port: {{ $port }}
      targetPort: http
{{- end }}
{{- if $root.Values.podDisruptionBudget.enabled }}
---
# Voluntary evictions (node drains) take one pod of the role at a time; each drains first.
apiVersion: policy/v1
kind: PodDisruptionBudget
metadata:
  name: {{ $full }}-{{ $role }}
  labels:
    {{- include "pdmesh.labels" $ctx | nindent 4 }}
spec:
  maxUnavailable: {{ $root.Values.podDisruptionBudget.maxUnavailable }}
  selector:
    matchLabels:
      {{- include "pdmesh.selectorLabels" $ctx | nindent 6 }}
{{- end }}
{{- end }}
