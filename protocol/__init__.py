"""Wire protocol: message definitions, codec, shared-memory arena, sockets, run-dir layout."""
