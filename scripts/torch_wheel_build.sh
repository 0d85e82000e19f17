#!/usr/bin/env bash
# memtune built against the LibTorch inside an installed PyTorch wheel (`pip install torch`
# on a GPU machine brings LibTorch, CUDA's libraries and NCCL), then tested there.
#
# Needs: python3 with torch; cmake >= 3.18; ninja or make; a C++17 compiler; for a CUDA
# wheel, nvcc of the wheel's CUDA major version; and the libraries scripts/setup.sh lists
# (yaml-cpp, spdlog, nlohmann-json, CLI11, PCRE2, GoogleTest), installed or under
# DEPS_PREFIX. The wheel ships no gloo headers: CPU multi-process training is refused in
# such a build (NCCL on GPUs works), and its tests skip themselves.
#
# Environment:
#   PYTHON       the python with torch (default python3)
#   BUILD_DIR    build tree (default build-torch-wheel)
#   JOBS         build jobs (default: all cores)
#   CUDA_ARCHS   architectures of memtune's kernels (default native: the GPU present)
#   DEPS_PREFIX  extra install prefix searched for the libraries above
#   CTEST_ARGS   run ctest with these arguments after the build (e.g. "-L unit"); unset: no tests
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
py=${PYTHON:-python3}
build=${BUILD_DIR:-$root/build-torch-wheel}
jobs=${JOBS:-$(nproc)}

read -r torch_version torch_cuda torch_cmake < <("$py" -c \
  'import torch; print(torch.__version__, torch.version.cuda or "none", torch.utils.cmake_prefix_path)')
echo "torch_wheel_build: torch $torch_version (CUDA $torch_cuda) from $("$py" -c 'import torch; print(torch.__file__)')"

prefixes="$torch_cmake"
[ -n "${DEPS_PREFIX:-}" ] && prefixes="$DEPS_PREFIX;$prefixes"
args=(-DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$prefixes")
command -v ninja >/dev/null && args+=(-G Ninja)
if [ "$torch_cuda" != none ]; then
  nvcc=${CUDACXX:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
  args+=(-DMEMTUNE_CUDA=ON -DCMAKE_CUDA_COMPILER="$nvcc" -DMEMTUNE_CUDA_ARCHITECTURES="${CUDA_ARCHS:-native}")
  # The wheel's libraries find CUDA's (nvidia-* wheels) through their own RUNPATH; the linker
  # needs the same directories to resolve them when linking executables.
  link_dirs=$("$py" - <<'EOF'
import glob, os
try:
    import nvidia
    roots = list(nvidia.__path__)
except ImportError:
    roots = []
print(":".join(sorted({os.path.dirname(p) for r in roots for p in glob.glob(r + "/**/lib/*.so*", recursive=True)})))
EOF
)
  [ -n "$link_dirs" ] && args+=(-DCMAKE_EXE_LINKER_FLAGS="-Wl,-rpath-link,$link_dirs"
                                 -DMEMTUNE_CUDA_LIB_DIRS="${link_dirs//:/;}")
fi

start=$(date +%s)
cmake -S "$root" -B "$build" "${args[@]}"
cmake --build "$build" -j "$jobs" -- ${KEEP_GOING:+-k 0}
echo "torch_wheel_build: built in $(( $(date +%s) - start )) s in $build"
"$build/memtune" --version
if [ -n "${CTEST_ARGS+x}" ]; then
  cd "$build" && ctest --output-on-failure -j "$jobs" $CTEST_ARGS
fi
