#!/usr/bin/env bash
# Debian packages mlxr uses on Linux: OpenBLAS (several times faster float32 matmuls than the
# mlx CPU wheel's reference BLAS; the fallback for the cmeel-openblas wheel, and it brings the
# libgfortran that wheel links), docker-registry (a real OCI registry for the store tests) and
# systemd (systemd-analyze, for the service unit's tests), chromium (the dashboard's
# browser tests) and a C compiler (the runner builds the cblas shim and its row kernel on
# demand: shared/native.py; without one it keeps slower fallbacks).
# Installs only what is missing, and only where apt-get and root (or sudo) are available.
set -u
[ "$(uname -s)" = Linux ] || exit 0
command -v apt-get >/dev/null 2>&1 || { echo "system-deps: no apt-get; install OpenBLAS yourself for speed"; exit 0; }
want=()
[ -e /usr/lib/x86_64-linux-gnu/libopenblas.so.0 ] || [ -e /usr/lib/aarch64-linux-gnu/libopenblas.so.0 ] || want+=(libopenblas0-pthread)
command -v cc >/dev/null 2>&1 || command -v gcc >/dev/null 2>&1 || want+=(gcc libc6-dev)
if [ "${1:-}" = --test ]; then
  command -v docker-registry >/dev/null 2>&1 || [ -x /usr/bin/docker-registry ] || want+=(docker-registry)
  # systemd-analyze checks the unit `mlxr service install` writes (nothing is started)
  command -v systemd-analyze >/dev/null 2>&1 || want+=(systemd)
  # a real browser for the dashboard's tests (driven headless by Playwright)
  [ -x /usr/bin/chromium ] || want+=(chromium)
fi
[ ${#want[@]} -eq 0 ] && exit 0
sudo=""
[ "$(id -u)" -eq 0 ] || { command -v sudo >/dev/null 2>&1 && sudo="sudo -n"; }
if [ "$(id -u)" -ne 0 ] && [ -z "$sudo" ]; then
  echo "system-deps: not root; skipping apt-get install ${want[*]}"; exit 0
fi
echo "system-deps: installing ${want[*]}"
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -qq >/dev/null && $sudo apt-get install -y -qq "${want[@]}" >/dev/null
