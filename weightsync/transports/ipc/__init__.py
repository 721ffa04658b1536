"""Internal. The ipc transport: bucket buffers on the sender's device, shared by handle (transport.py,
the ring's two ends in ring.py, handles and control words in wire.py; whether this process can
share them: support.py)."""
