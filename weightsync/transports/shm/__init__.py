"""Internal. The shm transport: whole versions in host segments, or a streaming ring when they do not fit."""
