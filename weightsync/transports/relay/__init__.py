"""Internal. The relay transport: one copy of a version per receiving host, passed from host to host
(transport.py), and read by the other receivers of a host from its shm segment."""
