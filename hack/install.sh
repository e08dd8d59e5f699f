#!/usr/bin/env bash
# Installs kubevirt-rs on the cluster KUBECONFIG names, the way KubeVirt is installed: the
# operator manifest, then the KubeVirt CR; virt-operator installs everything else (CRDs, RBAC,
# certificates, virt-api, virt-controller, virt-handler). Waits until the CR is Available and
# virt-handler has marked a node schedulable.
# MANIFESTS names the directory of kubevirt-operator.yaml and kubevirt-cr.yaml: default
# manifests/release (images kubevirt-rs/<name>:latest); a release's _out/manifests pins them.
set -euo pipefail
cd "$(dirname "$0")/.."
manifests=${MANIFESTS:-manifests/release}

kubectl apply -f "$manifests/kubevirt-operator.yaml"
kubectl wait --for condition=established --timeout=60s crd/kubevirts.kubevirt.io >/dev/null
kubectl -n kubevirt rollout status deployment/virt-operator --timeout=180s
kubectl apply -f "$manifests/kubevirt-cr.yaml"
if ! kubectl -n kubevirt wait kv kubevirt --for condition=Available --timeout=300s; then
  kubectl -n kubevirt get kv kubevirt -o yaml >&2 || true
  echo "install.sh: the KubeVirt CR did not become Available; see: kubectl -n kubevirt logs deploy/virt-operator" >&2
  exit 1
fi
for _ in $(seq 180); do
  [[ -n $(kubectl get nodes -l kubevirt.io/schedulable=true -o name) ]] && exit 0
  sleep 1
done
echo "install.sh: virt-handler did not mark a node schedulable; see: kubectl -n kubevirt logs ds/virt-handler" >&2
exit 1
