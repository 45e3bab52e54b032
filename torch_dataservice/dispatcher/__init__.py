"""The dispatcher: control plane of the service (datasets, workers, jobs, iterations, splits)."""
