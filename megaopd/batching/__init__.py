"""megaopd.batching: a step's rows -> micro-batches, in one place below scoring and the trainer.

    owners      RowOwners: the actor data-parallel replica that trains each row (where its scores land)
    shares      the rows each data-parallel replica takes (contiguous blocks, or balanced_partition)
    packing     packed rows: several sequences in one [1, t] row (PackedRow, pack_by_budget)
    padding     pad_rows: equal-shaped micro-batches
"""
