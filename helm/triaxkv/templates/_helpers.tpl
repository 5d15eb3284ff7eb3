{{/* Names: <release>-<chart> unless overridden, cut to 63 characters. */}}
{{- define "triaxkv.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "triaxkv.fullname" -}}
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

{{/* Object names; the StatefulSet's leaves room for "-<ordinal>" and the
     controller-revision-hash label. */}}
{{- define "triaxkv.manager" -}}
{{- printf "%s-kvmanager" (include "triaxkv.fullname" .) | trunc 52 | trimSuffix "-" -}}
{{- end -}}
{{- define "triaxkv.managerHeadless" -}}
{{- printf "%s-headless" (include "triaxkv.manager" .) -}}
{{- end -}}
{{- define "triaxkv.worker" -}}
{{- printf "%s-kvworker" (include "triaxkv.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "triaxkv.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/name: {{ include "triaxkv.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{/* Selector labels of one component ("kvmanager" or "kvworker"). */}}
{{- define "triaxkv.selector" -}}
app.kubernetes.io/name: {{ include "triaxkv.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "triaxkv.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/* Every manager's stable address through the headless Service, joined
     by "," (the --manager list of workers and clients). */}}
{{- define "triaxkv.managerAddresses" -}}
{{- $addrs := list -}}
{{- range $i := until (int .Values.manager.replicas) -}}
{{- $addrs = append $addrs (printf "%s-%d.%s.%s.svc:%d" (include "triaxkv.manager" $) $i (include "triaxkv.managerHeadless" $) $.Release.Namespace (int $.Values.manager.port)) -}}
{{- end -}}
{{- join "," $addrs -}}
{{- end -}}

{{/* The manager's --metadata flag. */}}
{{- define "triaxkv.metadataFlag" -}}
{{- if eq .Values.manager.metadata.mode "etcd" -}}
{{- if not .Values.manager.metadata.etcd.endpoints -}}
{{- fail "manager.metadata.mode=etcd needs manager.metadata.etcd.endpoints (host:port of each etcd member)" -}}
{{- end -}}
--metadata=etcd://{{ join "," .Values.manager.metadata.etcd.endpoints }}
{{- else -}}
--metadata=file:{{ .Values.manager.persistence.mountPath }}
{{- end -}}
{{- end -}}

{{/* The --tls_* flags of .role (manager, worker) as YAML list items, one
     per line; nothing unless tls.enabled. The Secret's files are mounted
     at tls.mountPath (triaxkv.tlsVolume). */}}
{{- define "triaxkv.tlsArgs" -}}
{{- $t := .root.Values.tls -}}
{{- if $t.enabled -}}
{{- $secret := ternary $t.managerSecret $t.workerSecret (eq .role "manager") -}}
{{- if not $secret -}}
{{- fail (printf "tls.enabled needs tls.%sSecret (a Secret with tls.crt, tls.key and ca.crt)" .role) -}}
{{- end -}}
- --tls_cert={{ $t.mountPath }}/tls.crt
- --tls_key={{ $t.mountPath }}/tls.key
- --tls_ca={{ $t.mountPath }}/ca.crt
- --tls_require_client_cert={{ $t.requireClientCert }}
- --tls_worker_server_name={{ $t.workerServerName }}
- --tls_worker_names={{ join "," $t.workerNames }}
{{- if eq .role "worker" }}
- --tls_manager_names={{ join "," $t.managerNames }}
{{- end }}
{{- end -}}
{{- end -}}

{{/* The volume of .role's TLS Secret (only with tls.enabled). */}}
{{- define "triaxkv.tlsVolume" -}}
{{- $t := .root.Values.tls -}}
- name: tls
  secret:
    secretName: {{ ternary $t.managerSecret $t.workerSecret (eq .role "manager") | quote }}
    defaultMode: 288  # 0440: readable by the pod's fsGroup
{{- end -}}

{{/* Probes: gRPC health without TLS. Kubernetes' gRPC probes cannot speak
     TLS, so with tls.enabled they are HTTPS GETs of the daemon's
     --http_listen (/readyz, /healthz; the kubelet does not verify the
     certificate). .port: the gRPC port; .httpPort: the HTTPS port;
     .ready / .live: the gRPC services asked. */}}
{{- define "triaxkv.probe" -}}
{{- if .root.Values.tls.enabled -}}
httpGet: {path: {{ .path }}, port: {{ .httpPort }}, scheme: HTTPS}
{{- else -}}
grpc: {port: {{ .port }}, service: {{ .service | quote }}}
{{- end -}}
{{- end -}}

{{/* The --auth flags of a manager or a worker (auth.enabled), their Secret
     mounted at auth.mountPath (triaxkv.authVolume). */}}
{{- define "triaxkv.authArgs" -}}
{{- $a := .root.Values.auth -}}
{{- if $a.enabled -}}
{{- $secret := ternary $a.adminTokenSecret $a.workerTokenSecret (eq .role "manager") -}}
{{- if not $secret -}}
{{- fail (printf "auth.enabled needs auth.%s (a Secret with %s)" (ternary "adminTokenSecret" "workerTokenSecret" (eq .role "manager")) (ternary "admin.token" "worker.token" (eq .role "manager"))) -}}
{{- end -}}
{{- if eq .role "manager" }}
- --auth=token
- --admin_token_file={{ $a.mountPath }}/admin.token
- --capability_ttl_seconds={{ int64 $a.capabilityTtlSeconds }}
{{- else }}
- --token_file={{ $a.mountPath }}/worker.token
{{- end }}
{{- end -}}
{{- end -}}

{{- define "triaxkv.authVolume" -}}
{{- $a := .root.Values.auth -}}
- name: auth
  secret:
    secretName: {{ ternary $a.adminTokenSecret $a.workerTokenSecret (eq .role "manager") | quote }}
    defaultMode: 288  # 0440: readable by the pod's fsGroup, no one else
{{- end -}}
