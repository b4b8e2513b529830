"""Connections that move, as gRPC's C core sees them (gRFC A9): through a counting TCP proxy,
a grpcio channel calls a server started with `--max-connection-age-seconds 1` for up to 15 s,
until it has opened three connections. Every call must succeed: the GOAWAY moves the next
calls to a new connection without failing one. Usage: connection_age.py HOST:PORT"""

import socket
import sys
import threading
import time

import grpc

import payledger_pb2 as pb
import payledger_pb2_grpc as rpc

target_host, target_port = sys.argv[1].rsplit(":", 1)
accepted = 0


def pipe(source, sink):
    try:
        while data := source.recv(65536):
            sink.sendall(data)
    except OSError:
        pass
    finally:
        for end in (source, sink):
            try:
                end.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def serve(listener):
    global accepted
    while True:
        client, _ = listener.accept()
        accepted += 1
        upstream = socket.create_connection((target_host, int(target_port)))
        threading.Thread(target=pipe, args=(client, upstream), daemon=True).start()
        threading.Thread(target=pipe, args=(upstream, client), daemon=True).start()


listener = socket.socket()
listener.bind(("127.0.0.1", 0))
listener.listen()
threading.Thread(target=serve, args=(listener,), daemon=True).start()

channel = grpc.insecure_channel(f"127.0.0.1:{listener.getsockname()[1]}")
accounts = rpc.AccountServiceStub(channel)
calls, started = 0, time.monotonic()
while accepted < 3:
    if time.monotonic() - started > 15:
        sys.exit(f"connection age: {accepted} connection(s) in 15 s, {calls} calls; expected 3")
    # A failure raises grpc.RpcError and fails the check.
    accounts.OpenAccount(pb.OpenAccountRequest(account_id=f"age-{calls}", currency="USD"), timeout=5)
    calls += 1
    time.sleep(0.02)
print(f"connection age: {calls} calls over {accepted} connections, none failed")
