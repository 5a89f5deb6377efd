#!/usr/bin/env bash
# Installs the Debian packages porter builds and tests with. Idempotent: when every package
# is already present it does nothing (no apt-get update, no network).
set -euo pipefail

packages=(
  # toolchain
  cmake ninja-build ccache g++ make pkg-config
  # libraries
  libdnnl-dev libgloo-dev libboost-dev nlohmann-json3-dev libcli11-dev libspdlog-dev
  # testing
  googletest libgtest-dev libgmock-dev libbenchmark-dev
  # the memory page's browser test (headless)
  chromium
  # multi-process runs started by OpenMPI's launcher (mpirun -n 4 porter train ...)
  openmpi-bin
  # the example's scripts (token shards, a Hugging Face checkpoint): the standard library only
  python3
  # the porter Python module (python/) and its pytest suite
  pybind11-dev python3-dev python3-numpy python3-pytest
)

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all ${#packages[@]} packages present"
  exit 0
fi

echo "install-deps: installing ${missing[*]}"
sudo=""
if [ "$(id -u)" -ne 0 ]; then sudo="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -q
$sudo apt-get install -y -q --no-install-recommends "${missing[@]}"
