"""The worker: runs pipelines in executor processes and serves elements to clients."""
