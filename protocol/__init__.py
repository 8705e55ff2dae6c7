"""Wire protocol: message definitions (messages), msgpack codec (codec), HELLO check (handshake),
shared-memory arena (arena), socket factory (sockets), run-dir layout (rundir), errors (errors).

Nothing is imported here, so `import coli.protocol.messages` does not pull in zmq or numpy."""
