"""Pipeline parallelism (stages over torch.distributed) and its throughput schedulers (TD-Pipe)."""
