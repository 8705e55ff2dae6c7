"""Executor stage: runs the model forward, asks the RAM tier for experts, serves generate requests."""
