"""What every service process runs on: its settings (`config`), the NATS and HTTP runtime
(`service`), and what prefill, decode and colocated workers share (`worker`: model, KV pool,
transport, capacity audit, heartbeats).

`config` and `service` are torch-free (the gateway and admission use them); `worker` loads
the engine and is imported only by the worker roles.
"""
