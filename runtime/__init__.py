"""Process-wide concerns shared by every role: settings, Prometheus metrics, log set-up.

Below `actors/`, `gateway/` and the command line (`tandem/`), which all import it; it imports
nothing from them.
"""
