"""The tensor-parallel split (Megatron-LM style): plan the regions, shard each rank's model, cut its pieces."""
