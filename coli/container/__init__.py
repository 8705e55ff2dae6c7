"""The ColiStream container: dense-core file, tiled expert store, index, manifest."""
