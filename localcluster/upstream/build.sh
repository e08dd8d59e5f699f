#!/usr/bin/env bash
# Builds the upstream control plane (kube-apiserver, kube-controller-manager, kube-scheduler,
# kube-proxy, etcd), kubectl and our kubelet-streaming glue into one binary, `kube`, from the Go
# modules pinned in go.mod/go.sum, with a symlink per component beside it (so the directory can
# go first on PATH for a kubectl of the same release). The result is cached by the hash of its
# inputs: a second run with the same pins builds nothing. Prints the binary's path on stdout.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out_root=${KUBE_UPSTREAM_CACHE:-$(cd "$here/../.." && pwd)/.cache/upstream}

cd "$here"
key=$( (go version; cat go.mod go.sum ./*.go build.sh) | sha256sum | cut -c1-16)
out=$out_root/$key/kube
if [[ -x $out ]]; then
  echo "$out"
  exit 0
fi

version=$(go list -m -f '{{.Version}}' k8s.io/kubernetes)
[[ $version =~ ^v([0-9]+)\.([0-9]+)\. ]] || { echo "build.sh: unexpected k8s.io/kubernetes version $version" >&2; exit 1; }
major=${BASH_REMATCH[1]} minor=${BASH_REMATCH[2]}
# The release's own date, not the build's, so that the same pins give the same binary.
build_date=$(go mod download -json "k8s.io/kubernetes@$version" | jq -r .Time)
ldflags="-s -w"
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  ldflags+=" -X $pkg.gitVersion=$version -X $pkg.gitMajor=$major -X $pkg.gitMinor=$minor"
  ldflags+=" -X $pkg.gitTreeState=clean -X $pkg.buildDate=$build_date"
done

started=$SECONDS
echo "build.sh: building kube $version (etcd $(go list -m -f '{{.Version}}' go.etcd.io/etcd/server/v3)); a cold build takes a while" >&2
mkdir -p "$(dirname "$out")"
CGO_ENABLED=0 go build -trimpath -ldflags "$ldflags" -o "$out.tmp" .
for component in etcd kube-apiserver kube-controller-manager kube-scheduler kube-proxy kubectl; do
  ln -sfn kube "$(dirname "$out")/$component"
done
mv "$out.tmp" "$out"
echo "build.sh: built $out in $((SECONDS - started)) s ($(du -m "$out" | cut -f1) MiB)" >&2
echo "$out"
