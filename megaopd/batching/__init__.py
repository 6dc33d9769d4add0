"""megaopd.batching: a step's rows -> micro-batches, in one place below scoring and the trainer.

    owners      RowOwners: the actor data-parallel replica that trains each row (where its scores land)
    shares      the rows each data-parallel replica takes (contiguous blocks)
    padding     pad_rows: equal-shaped micro-batches
"""
