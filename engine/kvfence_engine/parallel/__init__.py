"""Tensor parallelism inside one engine: the model's heads, MLP and vocabulary split over the
ranks of a torch.distributed group, rank 0 scheduling and the others following its steps, the
read check run on every rank (docs/engine.md, "Tensor parallelism")."""
