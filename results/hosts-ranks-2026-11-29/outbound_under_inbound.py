"""Does a host's outbound flow keep its link rate while the host takes in flows at its link rate?
Raw TCP between isolated hosts (hostnet.Cluster, no Ray, links 1 Gbit/s): 64 MiB from host 2 to
host 3 alone, then while hosts 0 and 1 send 2 x 64 MiB each into host 2 (as the trainer ranks'
rows come into the first receiving host while it relays on). Root; from the repository root:
PYTHONPATH=.:benchmarks python results/hosts-ranks-2026-11-29/outbound_under_inbound.py"""
import subprocess, sys, time
from weightsync_bench.hostnet import Cluster
PY = sys.executable
SERVE = """
import socket, sys, time
srv = socket.create_server((sys.argv[1], 0)); srv.listen(8)
print(srv.getsockname()[1], flush=True)
n = int(sys.argv[2]); import threading
res = []
def one(conn):
    got, t0 = 0, None
    while True:
        c = conn.recv(1 << 20)
        if not c: break
        t0 = t0 or time.perf_counter(); got += len(c)
    res.append((got, time.perf_counter() - t0))
ts = []
for _ in range(n):
    conn, _ = srv.accept(); t = threading.Thread(target=one, args=(conn,)); t.start(); ts.append(t)
for t in ts: t.join()
print(res, flush=True)
"""
SEND = """
import socket, sys, time
payload = b"\\x5a" * int(sys.argv[3])
t0 = time.perf_counter()
with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=60) as s:
    s.sendall(payload)
print(time.perf_counter() - t0, flush=True)
"""
def serve(c, host, n):
    p = c.run(host, [PY, "-c", SERVE, c.address(host), str(n)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return p, p.stdout.readline().strip()
def send(c, src, dst, port, nbytes):
    return c.run(src, [PY, "-c", SEND, c.address(dst), port, str(nbytes)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
with Cluster(hosts=4, link_gbit=1.0, ray=False) as c:
    for mode in ("alone", "with-inbound"):
        s3, p3 = serve(c, 3, 1)
        s2, p2 = serve(c, 2, 4)
        senders = []
        if mode == "with-inbound":
            senders = [send(c, h, 2, p2, 64 << 20) for h in (0, 0, 1, 1)]
        else:
            senders = []
            s2.kill()
        time.sleep(0.2)
        relay = send(c, 2, 3, p3, 64 << 20)
        print(mode, "host2->host3 64 MiB:", relay.communicate(timeout=120)[0].strip(), "s (link time 0.537)")
        print("   host3 got:", s3.communicate(timeout=120)[0].strip())
        for s in senders:
            s.communicate(timeout=120)
        if mode == "with-inbound":
            print("   host2 got:", s2.communicate(timeout=120)[0].strip())
        s2.wait()
