#!/usr/bin/env bash
# Debian packages the simulated robot needs for headless rendering (MuJoCo through EGL/Mesa).
# Installs only what is missing; needs root (or sudo) the first time.
set -euo pipefail
pkgs=(libegl1 libegl-mesa0 libgl1 libgl1-mesa-dri libgles2)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then exit 0; fi
echo "installing Debian packages for headless rendering: ${missing[*]}"
SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
