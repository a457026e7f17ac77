# Sourced by the benchmark scripts that start specstand servers themselves.
wait_ready() {  # wait_ready PORT PID LOG: until the server on PORT answers, or stop if its process PID exited
  until curl -sf "http://127.0.0.1:$1/health" > /dev/null; do
    kill -0 "$2" 2>/dev/null || { echo "the server on port $1 exited: see $3" >&2; exit 1; }
    sleep 1
  done
}
