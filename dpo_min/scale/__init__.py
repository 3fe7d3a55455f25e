"""Scale-out: FSDP2 sharding, DeepSpeed ZeRO, activation offloading, packed (segmented) attention."""
