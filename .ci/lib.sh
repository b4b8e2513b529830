# Shared by the .ci scripts that run a real server and a Python tool against it.

# A virtual environment in $1 with the packages of the requirements file $2, made again only
# when that file changed since it was made.
python_venv() {
  local venv=$1 requirements=$2
  if [ ! -x "$venv/bin/python" ] || ! cmp -s "$requirements" "$venv/requirements.txt"; then
    rm -rf "$venv"
    python3 -m venv "$venv"
    "$venv/bin/pip" install --quiet --disable-pip-version-check -r "$requirements"
    cp "$requirements" "$venv/requirements.txt"
  fi
}

# A free TCP port on loopback.
free_port() {
  python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# Waits up to $2 tenths of a second (default 100) until 127.0.0.1:$1 accepts a connection.
wait_for_port() {
  local port=$1 tries=${2:-100}
  for _ in $(seq 1 "$tries"); do
    if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then return 0; fi
    sleep 0.1
  done
  return 1
}
