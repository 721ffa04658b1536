"""Host shared-memory segments (shm's versions, ipc's control block and host buffers) and
how much of it a node can give."""
