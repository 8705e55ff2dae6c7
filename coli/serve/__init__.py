"""The serving side: the HTTP gateway, its API adapters, the run clients and the gateway metrics."""
