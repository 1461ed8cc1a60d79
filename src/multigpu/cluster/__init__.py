"""Where we run: cluster schedulers that fill the multi-node layout from their environment."""
