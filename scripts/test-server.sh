#!/usr/bin/env bash
# Runs the live-server tests (tests/server/) against `target/debug/pagoda serve` with the
# default model, using the official `openai` Python package.
#
#   bash scripts/test-server.sh            # all tests
#   bash scripts/test-server.sh -k stop    # extra arguments go to pytest
#
# Environment: PAGODA_BIN (default target/debug/pagoda; built with `cargo build -p pagoda-cli`
# when missing), PAGODA_TEST_VENV (default target/server-test-venv), PYTHON (default python3),
# PAGODA_WHEELS (install the Python clients offline from this folder of wheels),
# PAGODA_SERVE_ARGS (extra `pagoda serve` flags), PAGODA_SERVER_LOG (keep the server log here),
# PAGODA_NO_BROWSER (do not try to install the browser test's selenium and Chromium).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

MODEL="models/SmolLM2-135M-Instruct.Q4_1.gguf"
if [[ ! -f "$MODEL" ]]; then
    echo "test-server: $MODEL is missing; run scripts/fetch-model.sh first" >&2
    exit 1
fi

BIN="${PAGODA_BIN:-target/debug/pagoda}"
if [[ ! -x "$BIN" ]]; then
    echo "test-server: building pagoda-cli" >&2
    cargo build -p pagoda-cli
fi

VENV="${PAGODA_TEST_VENV:-target/server-test-venv}"
PYTHON="${PYTHON:-python3}"
if [[ ! -x "$VENV/bin/python" ]]; then
    "$PYTHON" -m venv "$VENV"
fi
# numpy and gguf run the embedding test's oracle (a numpy forward pass of the model).
if ! "$VENV/bin/python" -c "import openai, requests, pytest, numpy, gguf, jsonschema" 2>/dev/null; then
    if [[ -n "${PAGODA_WHEELS:-}" ]]; then
        # Offline machines (the GPU machine): wheels downloaded beforehand.
        "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --no-index \
            --find-links "$PAGODA_WHEELS" openai requests pytest numpy gguf jsonschema
    else
        "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --no-cache-dir openai requests pytest numpy gguf jsonschema
    fi
fi

# The chat page's browser test (tests/server/test_webui.py) drives Debian's headless Chromium
# with selenium; without them it skips. Installed here when possible (root and apt-get);
# PAGODA_NO_BROWSER=1 skips the attempt (machines without a package mirror).
if [[ -n "${PAGODA_NO_BROWSER:-}" ]]; then
    :
elif ! "$VENV/bin/python" -c "import selenium" 2>/dev/null; then
    if [[ -n "${PAGODA_WHEELS:-}" ]]; then
        pip_source=(--no-index --find-links "$PAGODA_WHEELS")
    else
        pip_source=(--no-cache-dir)
    fi
    "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "${pip_source[@]}" selenium \
        || echo "test-server: selenium could not be installed; the browser test will skip" >&2
fi
if [[ -z "${PAGODA_NO_BROWSER:-}" ]] && { ! command -v chromium >/dev/null || ! command -v chromedriver >/dev/null; }; then
    if [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null; then
        echo "test-server: installing chromium and chromium-driver for the browser test" >&2
        (apt-get install -y -q chromium chromium-driver >/dev/null 2>&1 \
            || { apt-get update -q >/dev/null 2>&1 \
                 && apt-get install -y -q chromium chromium-driver >/dev/null 2>&1; }) \
            || echo "test-server: apt-get could not install chromium; the browser test will skip" >&2
    else
        echo "test-server: no chromium/chromedriver and no apt-get as root; the browser test will skip" >&2
    fi
fi

free_port() {
    "$VENV/bin/python" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1]); s.close()'
}
PORT="$(free_port)"
WORK="$(mktemp -d -t pagoda-serve.XXXXXX)"
LOG="$WORK/serve.log"
# Two keys in a key file (the server takes either); the tests use the first.
API_KEY="test-key-$$"
printf '# live-server suite\n%s\n\nsecond-key-%s\n' "$API_KEY" "$$" >"$WORK/keys.txt"

# Small pool sizes keep the test fast; -np 8 lets eight clients run together.
# PAGODA_SERVE_ARGS adds flags (e.g. `--device cuda` on the GPU machine).
# shellcheck disable=SC2086
"$BIN" serve --port "$PORT" -c 1024 -np 8 --max-queue 16 --api-key-file "$WORK/keys.txt" \
    --max-body-bytes 1048576 --cors http://localhost:3000 ${PAGODA_SERVE_ARGS:-} >"$LOG" 2>&1 &
SERVER_PID=$!
TLS_PID=""
cleanup() {
    kill "$SERVER_PID" $TLS_PID 2>/dev/null || true
    wait "$SERVER_PID" $TLS_PID 2>/dev/null || true
    rm -rf "$WORK"
}
trap cleanup EXIT

# A second server on HTTPS, with a self-signed certificate for localhost and 127.0.0.1: made by
# the openssl command where there is one (it is on most machines, and a build of the rcgen
# example, crates/server/examples/self_signed_cert.rs, costs a clean CI run about 2 minutes),
# else by that example.
make_cert() { # DIR
    mkdir -p "$1"
    openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days 2 \
        -subj /CN=localhost -addext "subjectAltName=DNS:localhost,IP:127.0.0.1" \
        -keyout "$1/key.pem" -out "$1/cert.pem" >/dev/null 2>&1
}
CERT_MAKER="target/debug/examples/self_signed_cert"
if command -v openssl >/dev/null; then
    CERT_MAKER=make_cert
elif [[ ! -x "$CERT_MAKER" ]] && command -v cargo >/dev/null; then
    cargo build -q -p pagoda-server --example self_signed_cert || true
fi
TLS_URL=""
if { [[ $CERT_MAKER == make_cert ]] || [[ -x "$CERT_MAKER" ]]; } && "$CERT_MAKER" "$WORK/tls"; then
    TLS_PORT="$(free_port)"
    # shellcheck disable=SC2086
    "$BIN" serve --port "$TLS_PORT" -c 256 -np 2 --api-key-file "$WORK/keys.txt" \
        --ssl-cert-file "$WORK/tls/cert.pem" --ssl-key-file "$WORK/tls/key.pem" \
        ${PAGODA_SERVE_ARGS:-} >"$WORK/serve-tls.log" 2>&1 &
    TLS_PID=$!
    TLS_URL="https://127.0.0.1:$TLS_PORT"
else
    echo "test-server: no certificate maker ($CERT_MAKER); the HTTPS tests will skip" >&2
fi

wait_ready() { # url pid log [curl flags]
    local url="$1" pid="$2" log="$3"
    shift 3
    for _ in $(seq 1 120); do
        if curl -fsS "$@" "$url/health" >/dev/null 2>&1; then
            return 0
        fi
        if ! kill -0 "$pid" 2>/dev/null; then
            echo "test-server: the server at $url exited during start-up:" >&2
            cat "$log" >&2
            exit 1
        fi
        sleep 0.5
    done
    echo "test-server: the server at $url did not answer /health within 60 s:" >&2
    cat "$log" >&2
    exit 1
}
wait_ready "http://127.0.0.1:$PORT" "$SERVER_PID" "$LOG"
if [[ -n "$TLS_URL" ]]; then
    wait_ready "$TLS_URL" "$TLS_PID" "$WORK/serve-tls.log" --cacert "$WORK/tls/cert.pem"
fi

status=0
PAGODA_URL="http://127.0.0.1:$PORT" PAGODA_API_KEY="$API_KEY" PAGODA_BIN="$BIN" \
    PAGODA_API_KEY_FILE="$WORK/keys.txt" PAGODA_SERVER_LOG_FILE="$LOG" \
    PAGODA_TLS_URL="$TLS_URL" PAGODA_TLS_CA="$WORK/tls/cert.pem" \
    "$VENV/bin/python" -m pytest -q tests/server "$@" || status=$?
# Last: SIGTERM drains the server (a running stream finishes), which then exits 0.
if [[ $status -eq 0 ]]; then
    PAGODA_URL="http://127.0.0.1:$PORT" PAGODA_API_KEY="$API_KEY" PAGODA_SERVER_PID="$SERVER_PID" \
        "$VENV/bin/python" -m pytest -q tests/server/drain_check.py -p no:cacheprovider || status=$?
    if [[ $status -eq 0 ]]; then
        drain_rc=0
        wait "$SERVER_PID" || drain_rc=$?
        if [[ $drain_rc -ne 0 ]]; then
            echo "test-server: the drained server exited with status $drain_rc" >&2
            status=1
        fi
    fi
fi
# Then a bounded soak on a server of its own (64 clients, preemption, disconnects, a SIGTERM
# drain at the end); PAGODA_SOAK_ROUNDS=N makes it longer.
if [[ $status -eq 0 ]]; then
    PAGODA_BIN="$BIN" "$VENV/bin/python" -m pytest -q -s tests/server/soak_check.py \
        -p no:cacheprovider || status=$?
fi
if [[ $status -ne 0 ]]; then
    echo "test-server: failed; server log:" >&2
    tail -n 50 "$LOG" >&2
fi
if [[ -n "${PAGODA_SERVER_LOG:-}" ]]; then
    cp "$LOG" "$PAGODA_SERVER_LOG"
fi
exit $status
