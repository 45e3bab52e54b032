"""Seeing inside: Prometheus metrics, reader statistics, stage timings, logs and status text.

Floor 1: every component (dispatcher, worker, client) and the CLI use these pieces, and they
import nothing above the wire and the protos. prometheus_client is imported only where a
metrics endpoint or registry is asked for, so a process with metrics off never loads it.
"""
