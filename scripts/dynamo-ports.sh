# Sourced by scripts/test-dynamo.sh and scripts/bench-dynamo-routing.sh (needs $python).
# free_port: a free loopback port below 32768 (Dynamo reads DYN_SYSTEM_PORT as an i16).
free_port() {
    "$python" -c 'import random, socket
while True:
    s = socket.socket(); p = random.randrange(20000, 32768)
    try:
        s.bind(("127.0.0.1", p)); print(p); break
    except OSError: pass'
}
