#!/usr/bin/env bash
# The GPU build, checked on a machine without a GPU: memtune configured with
# MEMTUNE_CUDA=ON against Debian 13's LibTorch 2.6 (CUDA 12.4, NCCL 2.22), every target
# built (CUDA-only sources and .cu kernels included) and the test suite run on the CPU
# (tests named *_CUDA skip themselves), all inside a Debian 13 root.
#
# The root lives outside the checkout and is reused while its stamp matches the package
# list below; a new machine builds it (debootstrap + apt, a few minutes, about 11 GB).
# Needs root (debootstrap, chroot, mount).
#
# Environment:
#   MEMTUNE_GPU_ROOT      the Debian 13 root (default /var/cache/memtune/trixie-cuda)
#   MEMTUNE_DEBIAN_MIRROR Debian mirror (default: the one this machine's apt uses)
#   CUDNN_LIB             libcudnn.so.9 to give the root (default: searched, see below)
#   JOBS                  build jobs (default 2)
#   GPU_CTEST_ARGS        when set, run ctest with these arguments (e.g. "-L unit", "-R Nf4")
#                         instead of every unit-test binary directly
#   GPU_BUILD_DIR         build tree, a path inside the root (default /build/memtune)
# Arguments: --root-only (make the root, build nothing).
set -euo pipefail

src=$(cd "$(dirname "$0")/.." && pwd)
ROOT=${MEMTUNE_GPU_ROOT:-/var/cache/memtune/trixie-cuda}
JOBS=${JOBS:-2}
GPU_CTEST_ARGS=${GPU_CTEST_ARGS:-}
GPU_BUILD_DIR=${GPU_BUILD_DIR:-/build/memtune}

if [ "$(id -u)" != 0 ]; then
  exec sudo --preserve-env=MEMTUNE_GPU_ROOT,MEMTUNE_DEBIAN_MIRROR,CUDNN_LIB,JOBS,GPU_CTEST_ARGS,GPU_BUILD_DIR \
    bash "$0" "$@"
fi

# Bump ROOT_VERSION whenever the way the root is made changes; the package list is part
# of the stamp, so editing it also remakes (tops up) the root.
ROOT_VERSION=1
packages=(
  libtorch-cuda-dev nvidia-cuda-toolkit libnccl-dev  # LibTorch 2.6 + CUDA 12.4 + NCCL
  g++                           # GCC 14: memtune's C++, as Debian built LibTorch and fmt
  g++-13                        # nvcc's host compiler: CUDA 12.4 accepts GCC 13 at most
  cmake ninja-build ccache pkg-config
  libyaml-cpp-dev libspdlog-dev nlohmann-json3-dev libcli11-dev
  libgtest-dev libgmock-dev libgloo-cuda-dev libpcre2-dev  # gloo: its CUDA build, as LibTorch
)
stamp="$ROOT_VERSION ${packages[*]}"
stamp_file=$ROOT/.memtune-root-stamp

phase_start=$(date +%s)
phase() {  # prints the time the previous phase took
  local now; now=$(date +%s)
  [ -n "${phase_name:-}" ] && echo "gpu_build: ${phase_name}: $((now - phase_start)) s"
  phase_name=$1 phase_start=$now
  [ -n "$1" ] && echo "gpu_build: -- $1"
  return 0
}
total_start=$(date +%s)

ROOT_TAG=gpu_build
ROOT_ENV=(CCACHE_DIR=/var/cache/ccache)
# shellcheck source=scripts/debian_root.sh
source "$src/scripts/debian_root.sh"

# cuDNN: libtorch-cuda-2.6 depends on nvidia-cudnn, which is only a downloader that fetches
# cuDNN from NVIDIA's site when installed, unreachable here. The LibTorch files need only
# the library itself to link and load: libcudnn.so.9 is cuDNN 9's small front library
# (it opens the other cuDNN libraries when first used, which never happens without a GPU).
# A stand-in package satisfies the dependency, and the root gets this machine's own copy.
find_cudnn() {
  local c
  for c in "${CUDNN_LIB:-}" /usr/local/cuda/lib/libcudnn.so.9 /usr/local/cuda/lib64/libcudnn.so.9 \
           /usr/local/cuda/targets/x86_64-linux/lib/libcudnn.so.9 \
           /usr/lib/x86_64-linux-gnu/libcudnn.so.9; do
    [ -n "$c" ] && [ -e "$c" ] && { readlink -f "$c"; return; }
  done
  c=$(find / -xdev -name libcudnn.so.9 -not -path "$ROOT/*" 2>/dev/null | head -1)
  [ -n "$c" ] || { echo "gpu_build: no libcudnn.so.9 on this machine; set CUDNN_LIB" >&2; exit 1; }
  readlink -f "$c"
}

make_root() {
  local mirror; mirror=${MEMTUNE_DEBIAN_MIRROR:-$(default_mirror)}
  local cudnn; cudnn=$(find_cudnn)
  if [ ! -f "$ROOT/.memtune-debootstrap-done" ]; then
    phase "debootstrap trixie from $mirror"
    debootstrap_root trixie "$mirror" --components=main,contrib,non-free
  fi

  phase "apt-get install in the root"
  echo "deb $mirror trixie main contrib non-free" >"$ROOT/etc/apt/sources.list"
  prepare_root
  bind /dev/pts /dev/pts
  in_root apt-get update -qq

  # The stand-in nvidia-cudnn: a version just above the archive's, held, so apt neither
  # replaces it nor runs the downloader.
  local cudnn_version
  cudnn_version=$(in_root apt-cache show --no-all-versions nvidia-cudnn | sed -n 's/^Version: //p')
  if ! in_root dpkg-query -W -f='${Version}' nvidia-cudnn 2>/dev/null | grep -q memtune; then
    command -v equivs-build >/dev/null ||
      apt-get install -y -qq --no-install-recommends equivs >/dev/null
    local tmp; tmp=$(mktemp -d)
    cat >"$tmp/nvidia-cudnn.ctl" <<EOF
Section: non-free/libs
Priority: optional
Standards-Version: 4.6.2
Package: nvidia-cudnn
Version: ${cudnn_version}+memtune1
Architecture: all
Description: stand-in for nvidia-cudnn (memtune's GPU build root)
 nvidia-cudnn downloads cuDNN from NVIDIA at install time, which this machine cannot
 reach; memtune's scripts/gpu_build.sh gives the root libcudnn.so.9 itself.
EOF
    (cd "$tmp" && equivs-build nvidia-cudnn.ctl >/dev/null)
    cp "$tmp"/nvidia-cudnn_*_all.deb "$ROOT/tmp/nvidia-cudnn-standin.deb"
    rm -rf "$tmp"
    in_root dpkg -i /tmp/nvidia-cudnn-standin.deb >/dev/null
    in_root apt-mark hold nvidia-cudnn >/dev/null
    rm -f "$ROOT/tmp/nvidia-cudnn-standin.deb"
  fi
  install -m 0644 "$cudnn" "$ROOT/usr/lib/x86_64-linux-gnu/libcudnn.so.9"
  ln -sf libcudnn.so.9 "$ROOT/usr/lib/x86_64-linux-gnu/libcudnn.so"

  in_root apt-get install -y -qq --no-install-recommends "${packages[@]}" >"$ROOT.apt.log" 2>&1 ||
    { tail -30 "$ROOT.apt.log" >&2; exit 1; }
  in_root apt-get clean
  in_root ldconfig
  echo "$stamp" >"$stamp_file"
  cleanup
}

# The whole run is one function, so bash has read all of it before it starts.
main() {
  if [ -f "$stamp_file" ] && [ "$(cat "$stamp_file")" = "$stamp" ]; then
    echo "gpu_build: reusing the root $ROOT"
  else
    make_root
  fi
  if [ "${1:-}" = --root-only ]; then
    phase ""
    exit 0
  fi

  # The checkout is bound at /src/memtune; the build tree and ccache stay in the root, so a
  # warm machine rebuilds only what changed.
  phase "configure (MEMTUNE_CUDA=ON, LibTorch 2.6 + CUDA)"
  bind /proc /proc
  bind /sys /sys
  bind /dev /dev
  bind "$src" /src/memtune
  in_root cmake -S /src/memtune -B "$GPU_BUILD_DIR" -G Ninja \
    -DCMAKE_BUILD_TYPE=Release -DMEMTUNE_CUDA=ON \
    -DCMAKE_C_COMPILER=gcc -DCMAKE_CXX_COMPILER=g++ \
    -DCMAKE_CUDA_COMPILER=/usr/bin/nvcc -DCMAKE_CUDA_HOST_COMPILER=/usr/bin/g++-13 \
    -DTORCH_CUDA_ARCH_LIST="7.5;8.0;8.6;8.9;9.0" \
    >"$ROOT.configure.log" 2>&1 || { cat "$ROOT.configure.log" >&2; exit 1; }
  grep -E '^-- memtune:' "$ROOT.configure.log" || true

  phase "build every target"
  # -k 0: on an error, build the rest anyway, so one run lists every breakage.
  in_root bash -c "CCACHE_BASEDIR=/src/memtune cmake --build $GPU_BUILD_DIR -j $JOBS -- -k 0"

  if [ -n "$GPU_CTEST_ARGS" ]; then
    phase "ctest $GPU_CTEST_ARGS on the CPU"
    in_root bash -c "cd $GPU_BUILD_DIR && ctest --output-on-failure -j 2 $GPU_CTEST_ARGS"
  else
    # Every unit test (the test_<area> binaries, CTest label "unit"), one process per binary:
    # loading the CUDA LibTorch (1.2 GB libtorch_cuda) costs 1-2 s a process, which CTest's
    # process per test turns into 10 minutes here against 20 s.
    phase "unit tests (test_* binaries) on the CPU"
    in_root bash -s "$GPU_BUILD_DIR" <<'EOF'
cd "$1" && export OMP_WAIT_POLICY=passive OPENBLAS_THREAD_TIMEOUT=4
status=0
for t in tests/test_*; do
  [ -f "$t" ] && [ -x "$t" ] || continue
  echo "gpu_build: $t"
  "$t" --gtest_brief=1 || status=1
done
exit $status
EOF
  fi

  phase ""
  cleanup
  echo "gpu_build: total $(($(date +%s) - total_start)) s"
}

main "$@"
exit
