"""megaopd.batching: a step's rows -> micro-batches, in one place below scoring and the trainer.

    settings      BatchingSettings: the trainer's settings and the trained model's limits (batching reads no
                  config)
    shares        mini-batch rows and data-parallel shares (contiguous, or balanced by tokens and attention
                  cost), and row_owners: the replica that trains, and so holds the scores of, each row
    owners        RowOwners: that partition as the scoring passes route by it
    packing       packed rows: several sequences in one [1, t] row (PackedRow, pack_by_budget)
    padding       pad_rows / pad_to: equal-shaped micro-batches
    micro_batches MiniBatch -> MicroBatch (training step, padded or packed, with the step's loss
                  denominators) and ScoringMicroBatch (scoring passes)

A rollout batch's trip from the trainer to its micro-batches stays in this package: the trainer asks
shares.row_owners where rows go, and micro_batches.step_micro_batches for one mini-batch's micro-batches.
"""
