#!/bin/sh
# Install the Prometheus server binary (Debian package `prometheus`) if it is not there yet.
# Idempotent: does nothing when `prometheus` is already on PATH. The tests start the binary
# themselves with their own config, data directory and port; the package's system service
# is neither needed nor started (policy-rc.d keeps apt from starting it where that applies).
set -eu

if command -v prometheus >/dev/null 2>&1; then
    exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    SUDO="sudo"
fi

echo "installing the Debian package 'prometheus' (needed by the tests marked 'prometheus')" >&2
$SUDO apt-get update -q
DEBIAN_FRONTEND=noninteractive RUNLEVEL=1 $SUDO apt-get install -y -q --no-install-recommends prometheus

# The package may have started its service; stop it so it does not hold port 9090.
if command -v systemctl >/dev/null 2>&1 && systemctl is-active --quiet prometheus 2>/dev/null; then
    $SUDO systemctl stop prometheus || true
fi
command -v prometheus >/dev/null 2>&1 || { echo "prometheus is still not on PATH after installing" >&2; exit 1; }
