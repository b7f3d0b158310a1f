{{/* Chart name, truncated to 63 characters (DNS label). */}}
{{- define "dynpart.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Release-scoped name: <release>-dynpart, or just <release> when it contains the chart name. */}}
{{- define "dynpart.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "dynpart.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/name: {{ include "dynpart.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: dynpart
{{- end }}

{{/* Selector labels of one component: include "dynpart.selectorLabels" (list . "planner") */}}
{{- define "dynpart.selectorLabels" -}}
{{- $ctx := index . 0 -}}
app.kubernetes.io/name: {{ include "dynpart.name" $ctx }}
app.kubernetes.io/instance: {{ $ctx.Release.Name }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end }}

{{- define "dynpart.componentLabels" -}}
{{ include "dynpart.labels" (index . 0) }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end }}

{{/* The image reference of every workload: repository@digest when image.digest is set (a
digest pins the exact image; the tag is then not used), else repository:tag (default appVersion). */}}
{{- define "dynpart.image" -}}
{{- if .Values.image.digest -}}
{{ .Values.image.repository }}@{{ .Values.image.digest }}
{{- else -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end }}
{{- end }}

{{- define "dynpart.plannerName" -}}
{{ include "dynpart.fullname" . | trunc 55 | trimSuffix "-" }}-planner
{{- end }}

{{- define "dynpart.agentName" -}}
{{ include "dynpart.fullname" . | trunc 57 | trimSuffix "-" }}-agent
{{- end }}

{{- define "dynpart.catalogName" -}}
{{ include "dynpart.fullname" . | trunc 55 | trimSuffix "-" }}-catalog
{{- end }}

{{/* Where the extra catalog is mounted in both components' containers. */}}
{{- define "dynpart.catalogFile" -}}
/etc/dynpart/catalog/extra.yaml
{{- end }}

{{/* Fails rendering when catalog.extra is not a YAML mapping with a `models` list. */}}
{{- define "dynpart.checkCatalog" -}}
{{- if .Values.catalog.extra }}
{{- $doc := fromYaml .Values.catalog.extra }}
{{- if hasKey $doc "Error" }}
{{- fail (printf "catalog.extra is not a YAML mapping: %s" (get $doc "Error")) }}
{{- end }}
{{- if not (kindIs "slice" (get $doc "models")) }}
{{- fail "catalog.extra must be a YAML mapping with a `models:` list (the schema of dynpart/data/gpu-catalog.yaml)" }}
{{- end }}
{{- /* a model named twice: the planner and the agent refuse the file (dynpart/catalog.py) */}}
{{- $named := dict }}
{{- range $i, $m := get $doc "models" }}
{{- if kindIs "map" $m }}
{{- $name := toString (get $m "name") }}
{{- if hasKey $named $name }}
{{- fail (printf "catalog.extra: models[%d] (%s): the name of models[%v] too (a file names each model once)" $i $name (get $named $name)) }}
{{- end }}
{{- $_ := set $named $name $i }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}

{{/* Pod-level security context of the non-root components (the image's user 10001). */}}
{{- define "dynpart.restrictedPodSecurityContext" -}}
runAsNonRoot: true
{{- with .Values.planner.runAsUser }}
runAsUser: {{ . }}
runAsGroup: {{ . }}
{{- end }}
seccompProfile:
  type: RuntimeDefault
{{- end }}

{{- define "dynpart.restrictedContainerSecurityContext" -}}
privileged: false
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities:
  drop: [ALL]
{{- end }}

{{/* Fails rendering on Kubernetes < 1.30 (no admissionregistration.k8s.io/v1
ValidatingAdmissionPolicy) while a value that renders such policies is on, naming every such
value (admissionPolicy.enabled: node-write-policies.yaml; labelPolicy.enabled:
partitioning-label-policy.yaml; podEnvPolicy.enabled: pod-env-policy.yaml), so that one error
says all there is to turn off. */}}
{{- define "dynpart.checkPolicyKubeVersion" -}}
{{- if semverCompare "<1.30.0-0" .Capabilities.KubeVersion.Version }}
{{- $on := list }}
{{- if .Values.admissionPolicy.enabled }}{{ $on = append $on "admissionPolicy.enabled" }}{{ end }}
{{- if .Values.labelPolicy.enabled }}{{ $on = append $on "labelPolicy.enabled" }}{{ end }}
{{- if .Values.podEnvPolicy.enabled }}{{ $on = append $on "podEnvPolicy.enabled" }}{{ end }}
{{- $off := list }}
{{- range $on }}{{ $off = append $off (printf "%s=false" .) }}{{ end }}
{{- fail (printf "%s %s Kubernetes >= 1.30 (admissionregistration.k8s.io/v1 ValidatingAdmissionPolicy); this is %s: set %s" (include "dynpart.joinAnd" $on) (ternary "needs" "need" (eq (len $on) 1)) .Capabilities.KubeVersion.Version (include "dynpart.joinAnd" $off)) }}
{{- end }}
{{- end }}

{{/* A list of words as English: "a", "a and b", "a, b and c". */}}
{{- define "dynpart.joinAnd" -}}
{{- if le (len .) 1 }}{{ join "" . }}
{{- else }}{{ join ", " (initial .) }} and {{ last . }}
{{- end }}
{{- end }}

{{/* The directory the agent and the node's mps-control pod share, on the host under
agent.stateDir (both pods mount it): the agent's desired state of the MPS control daemon, the
supervisor's report (mps_control_dir). On the host, so that either pod can be replaced while the
other runs: the new one reads what the old one wrote, as after a restart of its container. */}}
{{- define "dynpart.mpsControlDir" -}}
{{ .Values.agent.stateDir }}/mps-control
{{- end }}

{{/* How MPS pods share memory with the daemon: agent.mpsShm.mode, or hostIPC where the values
still set agent.hostIPC: true (its meaning before agent.mpsShm). */}}
{{- define "dynpart.mpsShmMode" -}}
{{- if .Values.agent.hostIPC }}hostIPC{{ else }}{{ .Values.agent.mpsShm.mode }}{{ end }}
{{- end }}

{{/* The host directory of the MPS control daemon's /dev/shm (agent.mpsShm.mode tmpfs). */}}
{{- define "dynpart.mpsShmDir" -}}
{{ .Values.agent.stateDir }}/mps-shm
{{- end }}

{{/* A DaemonSet's updateStrategy from its value: rollingUpdate only with type RollingUpdate (a
--set of the type alone keeps the default's rollingUpdate, which OnDelete has no use for). */}}
{{- define "dynpart.updateStrategy" -}}
type: {{ .type }}
{{- if and (eq .type "RollingUpdate") .rollingUpdate }}
rollingUpdate:
  {{- toYaml .rollingUpdate | nindent 2 }}
{{- end }}
{{- end }}

{{- define "dynpart.mpsControlName" -}}
{{ include "dynpart.fullname" . }}-mps-control
{{- end }}

{{/* Where the agent and mps-control pods run: the labelled nodes (both, whatever the mode: a node
switched from MPS to MIG keeps its MPS pods until they end, and with them the daemon), off a node
whose driver GPU Operator is swapping. */}}
{{- define "dynpart.agentPlacement" -}}
{{- with .Values.agent.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
affinity:
  nodeAffinity:
    requiredDuringSchedulingIgnoredDuringExecution:
      nodeSelectorTerms:
        - matchExpressions:
            - key: dynpart.io/gpu-partitioning
              operator: In
              values: [mig, mps]
            {{- if .Values.agent.leaveDuringDriverUpgrade }}
            # GPU Operator's upgrade controller swaps the driver in these states: NVML and CUDA
            # clients (the agent, the MPS daemon) must be off the node, or the old kernel modules
            # cannot be unloaded; the DaemonSet controller removes them and brings them back once
            # the new driver is validated
            - key: nvidia.com/gpu-driver-upgrade-state
              operator: NotIn
              values: [pod-restart-required, validation-required]
            {{- end }}
{{- with .Values.agent.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/* The securityContext of mps-control's container, which runs the MPS control daemon: privileged
as the agent is (agent.privileged: what the daemon had in the agent's container before), else
only SETUID and SETGID (it starts each MPS server under its client's user and group ids), never
the agent's MIG capability. */}}
{{- define "dynpart.mpsControlSecurityContext" -}}
runAsUser: 0
runAsNonRoot: false
{{- if .Values.agent.privileged }}
privileged: true
{{- else }}
privileged: false
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities:
  drop: [ALL]
  add: [SETUID, SETGID]
{{- end }}
{{- end }}

{{/* The securityContext of the agent's container. */}}
{{- define "dynpart.agentSecurityContext" -}}
# root: the kubelet's PodResources socket is root-owned (mode 0600 or 0660). (The MPS daemon, which
# needs SETUID and SETGID, runs in mps-control: the chart always sets mps_control_dir.)
runAsUser: 0
runAsNonRoot: false
{{- if .Values.agent.privileged }}
# MIG (the agent): creating/destroying GPU and compute instances needs CAP_SYS_ADMIN on the
# host's GPU devices (see values.yaml agent.privileged).
privileged: true
{{- else }}
privileged: false
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities:
  drop: [ALL]
  {{- with .Values.agent.capabilities }}
  add:
    {{- toYaml . | nindent 4 }}
  {{- end }}
{{- end }}
{{- end }}

{{/* The API credential of the agent and the planner, as the ServiceAccount admission plugin would
mount it (automountServiceAccountToken: false on the pod): a token bound to the pod (for the agent,
it names the pod's node, which the node-write policy checks; the kubelet renews it at 80 % of its
lifetime, the client rereads it every minute), the cluster CA and the namespace. 3600 s, not the
auto-mounted 3607 s: the API server stretches a pod-bound token requested for exactly 3607 s to a
year (--service-account-extend-token-expiration, on by default), so a token copied out of the pod
would work for as long as the pod lives (docs/helm.md, "RBAC (least privilege)"). */}}
{{- define "dynpart.apiAccessVolume" -}}
- name: kube-api-access
  projected:
    defaultMode: 420  # 0644
    sources:
      - serviceAccountToken:
          path: token
          expirationSeconds: 3600
      - configMap:
          name: kube-root-ca.crt
          items:
            - key: ca.crt
              path: ca.crt
      - downwardAPI:
          items:
            - path: namespace
              fieldRef:
                apiVersion: v1
                fieldPath: metadata.namespace
{{- end }}

{{/* devicePlugin.devRoot without a trailing slash, "/" for the host's root. */}}
{{- define "dynpart.devRoot" -}}
{{- $r := trimSuffix "/" .Values.devicePlugin.devRoot -}}
{{- if $r }}{{ $r }}{{ else }}/{{ end -}}
{{- end }}

{{/* "true" when the agent's own plugin names devices by CDI (a cdi-* deviceListStrategy): it writes
a CDI spec in devicePlugin.cdi.dir, mounted at /host/cdi. */}}
{{- define "dynpart.cdi" -}}
{{- if hasPrefix "cdi-" .Values.devicePlugin.deviceListStrategy }}true{{ end -}}
{{- end }}

{{/* "true" when the agent mounts the host's <devRoot>/dev: for the DeviceSpecs, and for the control
nodes its CDI spec lists (those that exist). */}}
{{- define "dynpart.hostDev" -}}
{{- if or .Values.devicePlugin.deviceSpecs (include "dynpart.cdi" .) }}true{{ end -}}
{{- end }}
