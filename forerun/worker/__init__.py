"""One rank: `Worker` (process setup, torch.distributed, kernel choice, KV allocation) and
`ModelRunner` (persistent batch, input preparation, forward, sampling, async output copy).
"""
