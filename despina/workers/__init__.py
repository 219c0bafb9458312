"""Worker pools: read model streams through consumer groups, batch, run the backend, reply, ack."""
