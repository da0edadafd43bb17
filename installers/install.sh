#!/bin/sh
# Install specd for this user (Linux, macOS): an isolated virtual environment, the default
# model pair and the user service (systemd --user / launchd).  Re-run to update.
#
#   sh installers/install.sh [--no-models] [--no-service] [--tray] [--cpu|--gpu] [--dry-run]
#
# Environment: PYTHON (interpreter, 3.11+), SPECD_VENV (default
# ${XDG_DATA_HOME:-~/.local/share}/specd/venv), SPECD_RUNTIME=cpu|gpu (ONNX Runtime build;
# default gpu when nvidia-smi works, else cpu), SPECD_BIN_DIR (where the `specd` link goes,
# default ~/.local/bin).
set -eu

SRC=$(cd "$(dirname "$0")/.." && pwd)
VENV=${SPECD_VENV:-${XDG_DATA_HOME:-$HOME/.local/share}/specd/venv}
BIN_DIR=${SPECD_BIN_DIR:-$HOME/.local/bin}
TARGET=qwen2.5-coder-1.5b-instruct
DRAFT=qwen2.5-coder-0.5b-instruct
MODELS=1
SERVICE=1
TRAY=0
DRY=0
RUNTIME=${SPECD_RUNTIME:-}

say() { printf 'specd-install: %s\n' "$*" >&2; }
die() { say "error: $*"; exit 1; }
run() {
    say "+ $*"
    [ "$DRY" = 1 ] || "$@"
}

for arg in "$@"; do
    case $arg in
        --no-models) MODELS=0 ;;
        --no-service) SERVICE=0 ;;
        --tray) TRAY=1 ;;
        --cpu) RUNTIME=cpu ;;
        --gpu) RUNTIME=gpu ;;
        --dry-run) DRY=1 ;;
        -h|--help) sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) die "unknown option $arg (see --help)" ;;
    esac
done

[ -f "$SRC/pyproject.toml" ] || die "run this from a specd checkout ($SRC has no pyproject.toml)"

# a Python 3.11+
if [ -z "${PYTHON:-}" ]; then
    for p in python3.13 python3.12 python3.11 python3; do
        if command -v "$p" >/dev/null 2>&1 &&
            "$p" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
            PYTHON=$p
            break
        fi
    done
fi
[ -n "${PYTHON:-}" ] || die "specd needs Python 3.11 or newer (set PYTHON=/path/to/python3)"
"$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' ||
    die "$PYTHON is older than 3.11"

# onnxruntime and onnxruntime-gpu install the same module: exactly one of them
if [ -z "$RUNTIME" ]; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
        RUNTIME=gpu
    else
        RUNTIME=cpu
    fi
fi
case $RUNTIME in cpu|gpu) ;; *) die "SPECD_RUNTIME must be cpu or gpu, not $RUNTIME" ;; esac
EXTRAS=$RUNTIME
[ "$TRAY" = 1 ] && EXTRAS="$EXTRAS,tray"
OTHER=onnxruntime-gpu
[ "$RUNTIME" = gpu ] && OTHER=onnxruntime
say "installing specd from $SRC into $VENV (onnxruntime: $RUNTIME)"

if [ ! -x "$VENV/bin/python" ]; then
    run "$PYTHON" -m venv "$VENV"
fi
pip_() { "$VENV/bin/python" -m pip "$@"; }
pip_uninstall() { "$VENV/bin/python" -m pip uninstall --quiet --yes "$@" 2>/dev/null || true; }
run pip_ install --quiet --upgrade pip
run pip_uninstall specd "$OTHER"  # a clean reinstall from the checkout; one onnxruntime
run pip_ install --quiet "$SRC[$EXTRAS]"
SPECD="$VENV/bin/specd"

run mkdir -p "$BIN_DIR"
run ln -sf "$SPECD" "$BIN_DIR/specd"
case ":$PATH:" in
    *":$BIN_DIR:"*) ;;
    *) say "add $BIN_DIR to your PATH to run \`specd\` directly" ;;
esac

if [ "$MODELS" = 1 ]; then
    run "$SPECD" models pull "$TARGET"
    run "$SPECD" models pull "$DRAFT"
    # the service runs the speculative pair unless the config already names models
    cfg_lacks() {
        [ "$DRY" = 1 ] || "$SPECD" config show --json | "$VENV/bin/python" -c \
            'import json, sys; sys.exit(sys.argv[1] in json.load(sys.stdin)["values"])' "$1"
    }
    if cfg_lacks model; then run "$SPECD" config set model "$TARGET"; fi
    if cfg_lacks draft; then run "$SPECD" config set draft "$DRAFT"; fi
fi

if [ "$SERVICE" = 1 ]; then
    if ! run "$SPECD" install-service; then
        say "the user service could not be set up (see above); \`specd install-service\`"
        say "retries it, \`specd start\` starts the daemon by hand"
    fi
fi
say "done: \`specd status\`, \`specd generate --chat 'hello'\`, logs in \`specd status\`"
