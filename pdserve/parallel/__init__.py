"""Tensor parallelism: the collectives a sharded model calls (comm) and how a checkpoint and
a config are cut into one rank's shard (shard). Starting and driving the ranks is the
engine's (pdserve/engine/tp.py)."""
