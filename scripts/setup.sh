#!/usr/bin/env bash
# Installs the programs the end-to-end tests run for real (Debian 12). Needs root; does nothing that is already
# done. Used by .ci/run; run it once by hand (sudo scripts/setup.sh) before the privileged tests.
set -euo pipefail
# chromium and chromium-driver: tests/web_e2e.rs drives the web view (--web) in a headless browser.
packages=(iproute2 iputils-ping curl python3 iperf3 dnsutils dnsmasq-base nftables conntrack tshark procps nginx-light wrk prometheus chromium chromium-driver)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  if [[ $(id -u) != 0 ]]; then
    echo "setup: missing packages ${missing[*]}; run: sudo $0" >&2
    exit 1
  fi
  echo "setup: installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  # tshark asks whether non-root users may capture; answer no.
  echo "wireshark-common wireshark-common/install-setuid boolean false" | debconf-set-selections
  apt-get install -y -qq --no-install-recommends "${missing[@]}"
  # The tests start nginx with their own configuration inside namespaces; the host's own service is not wanted.
  if [[ " ${missing[*]} " == *" nginx-light "* ]] && command -v systemctl >/dev/null; then
    systemctl disable --now nginx >/dev/null 2>&1 || true
  fi
  # Likewise prometheus (tests/metrics_e2e.rs runs its own on loopback with a temporary configuration).
  if [[ " ${missing[*]} " == *" prometheus "* ]] && command -v systemctl >/dev/null; then
    systemctl disable --now prometheus prometheus-node-exporter >/dev/null 2>&1 || true
  fi
fi
