"""Internal. The broadcast transport: a collective from sender rank 0 over a process group of its own."""
