"""Process-wide concerns shared by every role: settings, Prometheus metrics, log set-up, child processes
and their supervision, which names may stand in a NATS subject (``names``).

Below `bus/` (whose embedded server is a child process), `actors/`, `gateway/` and the command line
(`tandem/`), which all import it; it imports nothing from them.
"""
