"""Distributed start-up: torch.distributed (nccl | gloo), megatron process groups, CPU compatibility."""
