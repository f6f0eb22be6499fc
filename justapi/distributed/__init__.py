"""Several processes: torch.distributed process groups and KV transfer between workers."""
