#!/usr/bin/env bash
# Installs every Debian package memtune's build, tests and quickstart need.
# Idempotent: when everything is present it returns in about a second.
set -euo pipefail

packages=(
  build-essential cmake ninja-build ccache pkg-config
  libtorch-dev libopenblas0-pthread          # LibTorch 1.13 (CPU) on OpenBLAS, not the reference BLAS
  libyaml-cpp-dev libspdlog-dev nlohmann-json3-dev libcli11-dev
  libgtest-dev libgmock-dev libgloo-dev
  libpcre2-dev
  python3-torch python3-numpy                # independent references in tests
  gnuplot-nox                                # memtune report's plots
  time                                       # peak-memory measurements in tests
)

missing=()
# Node.js runs the Hugging Face tokenizers library (npm package), the tokenizer reference.
# Machines that ship Node from another source already have npm; Debian's would conflict.
command -v npm >/dev/null 2>&1 || packages+=(nodejs npm)

for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done

if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]}"
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
