#!/usr/bin/env bash
# Set up (or update) the project's virtualenv in .venv: vlmrun, every plugin under plugins/ (qnn_htp with its aimet
# extra), torch for export, pytest. Idempotent and quick when nothing changed. Needs Python 3.11 and network access to PyPI.
set -euo pipefail
cd "$(dirname "$0")/.."

# onnxruntime-qnn's HTP libraries need libatomic.so.1 (Debian package libatomic1).
if ! /sbin/ldconfig -p 2>/dev/null | grep -q 'libatomic.so.1'; then
    echo "setup: installing libatomic1 (needed by onnxruntime-qnn)" >&2
    SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
    $SUDO apt-get update -qq && $SUDO apt-get install -y -qq libatomic1 >/dev/null
fi

# The docs test opens the built site in a real headless browser: Chromium's headless shell from Debian.
if ! command -v chromium-headless-shell >/dev/null 2>&1 && ! command -v chromium >/dev/null 2>&1; then
    echo "setup: installing chromium-headless-shell (the docs site's browser test)" >&2
    SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
    $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium-headless-shell >/dev/null
fi

PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || { echo "setup: creating .venv" >&2; "$PY" -m venv .venv; }

plugins=(plugins/*/)
stamp=.venv/.vlmrun-setup
want=$(cat pyproject.toml plugins/*/pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    exit 0
fi
echo "setup: installing packages into .venv (first time: several minutes, torch is large)" >&2
.venv/bin/python -m pip install -q --upgrade pip
# timm (FastVLM's vision tower) imports torchvision; this is the pair that imports on these machines.
.venv/bin/python -m pip install -q "torch==2.14.1" "torchvision==0.29.1"
args=(-e ".[export,test,serve,tune,docs]")
for p in "${plugins[@]}"; do
    case "$p" in
        plugins/qnn_htp/) args+=(-e "plugins/qnn_htp[aimet]") ;;  # with AIMET-ONNX (quantizer = "aimet")
        *) args+=(-e "${p%/}") ;;
    esac
done
.venv/bin/python -m pip install -q "${args[@]}"
echo "$want" > "$stamp"
echo "setup: done" >&2
