"""Supervisor: spawns, handshakes, watches and shuts down the stages; brokers clients."""
