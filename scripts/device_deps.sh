#!/usr/bin/env bash
# The C++ libraries memtune needs besides LibTorch (yaml-cpp, spdlog, fmt, nlohmann-json,
# CLI11, PCRE2, GoogleTest), as this Debian 12 machine's packages unpacked into a prefix,
# for a machine that has LibTorch (a PyTorch wheel) but neither these nor a way to fetch
# them: the lent GPU machine (docs/gpu-build.md). The prefix travels with the working tree;
# there, before scripts/torch_wheel_build.sh:
#   export DEPS_PREFIX=$PWD/.deps/usr LD_LIBRARY_PATH=$PWD/.deps/usr/lib/x86_64-linux-gnu
#
# Usage: bash scripts/device_deps.sh [PREFIX_DIR]   (default .deps; add /.deps/ to .git/info/exclude)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
dest=${1:-$root/.deps}
packages=(libyaml-cpp-dev libyaml-cpp0.7 libspdlog-dev libspdlog1.10 libfmt-dev libfmt9 nlohmann-json3-dev
          libcli11-dev libpcre2-dev libpcre2-8-0 libpcre2-16-0 libpcre2-32-0 libpcre2-posix3 libgtest-dev
          libgmock-dev googletest)
work=$(mktemp -d)
chmod 755 "$work"  # apt downloads as its own user
trap 'rm -rf "$work"' EXIT
(cd "$work" && apt-get download "${packages[@]}" >/dev/null)
mkdir -p "$work/tree"
for deb in "$work"/*.deb; do dpkg -x "$deb" "$work/tree"; done
# Symbolic links become files: the tree is copied onto another machine as plain files.
rm -rf "$dest"
mkdir -p "$dest"
cp -rL "$work/tree/." "$dest/"
echo "device_deps: ${#packages[@]} packages in $dest ($(du -sh "$dest" | cut -f1))"
