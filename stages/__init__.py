"""The stage processes (reader, RAM tier, executor) and the supervisor; each a pure core plus a thin process wrapper."""
