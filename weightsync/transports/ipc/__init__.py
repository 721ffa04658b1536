"""Internal. The ipc transport: bucket buffers on the sender's device, shared by handle."""
