"""The reading side: registering pipelines, joining jobs, fetching elements from workers."""
