"""The colocated engine: scheduler -> model runner -> sampler, one step at a time."""
