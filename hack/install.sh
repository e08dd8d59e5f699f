#!/usr/bin/env bash
# Installs kubevirt-rs on the cluster KUBECONFIG names, as virt-operator will: the CRDs, the
# KubeVirt CR, the certificates (hack/pki.sh into PKI_DIR) as KubeVirt's Secrets, everything in
# manifests/install/, the CA bundle of the APIServices and admission webhooks; then waits until
# virt-api and virt-controller are rolled out and virt-handler has marked a node schedulable.
# Usage: hack/install.sh PKI_DIR
# MANIFESTS names another directory of install manifests, e.g. the release's _out/manifests
# (our images pinned by digest).
set -euo pipefail
pki=${1:?usage: hack/install.sh PKI_DIR}
cd "$(dirname "$0")/.."
manifests=${MANIFESTS:-manifests/install}

kubectl apply -f manifests/crds/
kubectl wait --for condition=established --timeout=60s crd --all >/dev/null
kubectl apply -f "$manifests/00-namespace.yaml"
kubectl apply -f manifests/examples/kubevirt-cr.yaml

hack/pki.sh "$pki"
secret() {
  local name=$1
  shift
  kubectl -n kubevirt create secret generic "$name" "$@" --dry-run=client -o yaml | kubectl apply -f -
}
# virt-handler's console server: its certificate and the CA its clients' certificates chain to.
secret kubevirt-virt-handler-server-certs --from-file=tls.crt="$pki/server.crt" \
  --from-file=tls.key="$pki/server.key" --from-file=ca.crt="$pki/ca.crt"
# virt-api's client certificate for that server, and the CA the server's chains to.
secret kubevirt-virt-handler-certs --from-file=tls.crt="$pki/client.crt" \
  --from-file=tls.key="$pki/client.key" --from-file=ca.crt="$pki/ca.crt"
secret kubevirt-virt-api-certs --from-file=tls.crt="$pki/virt-api.crt" \
  --from-file=tls.key="$pki/virt-api.key"

kubectl apply -f "$manifests/"
ca=$(base64 -w0 <"$pki/ca.crt")
for apiservice in v1.subresources.kubevirt.io v1alpha3.subresources.kubevirt.io; do
  kubectl patch apiservice "$apiservice" --type merge -p "{\"spec\":{\"caBundle\":\"$ca\"}}" >/dev/null
done
for config in mutatingwebhookconfiguration/virt-api-mutator validatingwebhookconfiguration/virt-api-validator; do
  n=$(kubectl get "$config" -o jsonpath='{.webhooks[*].name}' | wc -w)
  patch=$(for ((i = 0; i < n; i++)); do
    printf '{"op":"add","path":"/webhooks/%d/clientConfig/caBundle","value":"%s"},' "$i" "$ca"
  done)
  kubectl patch "$config" --type json -p "[${patch%,}]" >/dev/null
done

kubectl -n kubevirt rollout status deployment/virt-api --timeout=180s
kubectl -n kubevirt rollout status deployment/virt-controller --timeout=180s
kubectl wait --for condition=Available --timeout=120s apiservice/v1.subresources.kubevirt.io
for _ in $(seq 180); do
  [[ -n $(kubectl get nodes -l kubevirt.io/schedulable=true -o name) ]] && exit 0
  sleep 1
done
echo "install.sh: virt-handler did not mark a node schedulable; see: kubectl -n kubevirt logs ds/virt-handler" >&2
exit 1
