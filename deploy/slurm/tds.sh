# Functions train.sbatch runs on its nodes (sourced, so a test can run the same commands).
#
# TDS_RUN_DIR   a directory on a filesystem every node of the job shares (port file, journal)
# TDS_CMD       how to run the CLI (default: torch-dataservice)
# TDS_HOST      address the servers bind (default: 0.0.0.0, every interface)
# TDS_PORT      the dispatcher's port (default: 5000); workers take free ports unless
#               TDS_WORKER_PORT / TDS_DATA_PORT fix them (a firewall between partitions)
# TORCH_DATASERVICE_TOKEN   the fleet's shared token (required beyond loopback)

tds_dispatcher() {
    # Writes HOST:PORT to $TDS_RUN_DIR/dispatcher.addr once serving; journals to the run dir,
    # so a dispatcher restarted by a requeued job step replays what it knew.
    exec ${TDS_CMD:-torch-dataservice} dispatcher \
        --host "${TDS_HOST:-0.0.0.0}" --port "${TDS_PORT:-5000}" \
        --fault-tolerant --work-dir "${TDS_RUN_DIR}/journal" \
        --port-file "${TDS_RUN_DIR}/dispatcher.addr"
}

tds_worker() {
    # Waits for the dispatcher's port file (a warning every 10 s), then serves; one executor
    # process per CPU Slurm gave this task. SIGTERM (scancel, end of the job) drains it.
    exec ${TDS_CMD:-torch-dataservice} worker \
        --dispatcher-file "${TDS_RUN_DIR}/dispatcher.addr" \
        --host "${TDS_HOST:-0.0.0.0}" --port "${TDS_WORKER_PORT:-0}" \
        --data-port "${TDS_DATA_PORT:-0}" --processes "${SLURM_CPUS_PER_TASK:-1}" \
        --drain-timeout-s "${TDS_DRAIN_TIMEOUT_S:-30}"
}

tds_wait_dispatcher() {
    # Prints grpc://HOST:PORT once the dispatcher wrote its port file (fails after $1 s).
    local deadline=$((SECONDS + ${1:-600}))
    until [ -s "${TDS_RUN_DIR}/dispatcher.addr" ]; do
        if [ "${SECONDS}" -ge "${deadline}" ]; then
            echo "no dispatcher address in ${TDS_RUN_DIR}/dispatcher.addr" >&2
            return 1
        fi
        sleep 1
    done
    echo "grpc://$(cat "${TDS_RUN_DIR}/dispatcher.addr")"
}
