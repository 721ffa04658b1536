"""Internal. The shm transport: whole versions in host segments (transport.py), or a streaming ring
when they do not fit the node's budget; its records (records.py) say which."""
