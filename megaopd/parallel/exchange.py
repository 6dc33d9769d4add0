"""Per-row data moved to the ranks that need it: one all_to_all_single of only the real positions.

    received_rows, values_NC = route_rows(values_NC, held, dests, positions, device)

`held[s]` lists the rows global rank s sends (empty for ranks that send nothing), `dests[b]` the global ranks
that receive row b, (a set: it is asked `rank in dests[b]`), `positions[b]` how many of row b's positions travel (a
row of L real tokens has L - 1).
Every rank knows all three (they are pure functions of the row lengths and the two layouts), so each rank
computes every send and receive count itself and no sizes are exchanged. On the sender, values_NC holds its
rows' positions end to end in `held[s]` order; a receiver gets, sender by sender in rank order, the rows of
that sender it is a destination of, in the sender's order (`received_rows`).

Fields of several dtypes travel as one float32 payload: int32 columns are reinterpreted bit for bit
(`pack_columns` / `unpack_columns`), so one collective carries them all and nothing is rounded.
"""

from __future__ import annotations

from typing import Collection, Sequence

import torch
import torch.distributed as dist

from megaopd.parallel.dist import global_rank, world_size


def route_rows(
    values_NC: torch.Tensor | None,
    held: Sequence[Sequence[int]],
    dests: Sequence[Collection[int]],
    positions: Sequence[int],
    width: int,
    device: torch.device,
) -> tuple[list[int], torch.Tensor]:
    """Collective over the world: see the module docstring. Returns the received rows and their positions
    [sum of their positions, width] (float32, on `device`)."""
    world, me = world_size(), global_rank()
    send_counts = [0] * world
    order: list[int] = []  # this rank's held rows grouped by destination (one row may go to several ranks)
    mine = list(held[me]) if me < len(held) else []
    offsets, o = {}, 0
    for b in mine:
        offsets[b], o = o, o + positions[b]
    for r in range(world):
        for b in mine:
            if r in dests[b]:
                send_counts[r] += positions[b]
                order.append(b)
    received, recv_counts = [], [0] * world
    for s in range(world):
        for b in held[s] if s < len(held) else []:
            if me in dests[b]:
                received.append(b)
                recv_counts[s] += positions[b]
    if values_NC is None or not mine:
        values_NC = torch.zeros(0, width, dtype=torch.float32, device=device)
    # The gather index of what is sent, built on the CPU and moved once (one small kernel per row on a GPU
    # would be hundreds of launches per pass).
    index = (
        torch.cat([torch.arange(offsets[b], offsets[b] + positions[b], device="cpu") for b in order]).to(device)
        if order
        else torch.zeros(0, dtype=torch.long, device=device)
    )
    send = values_NC.to(device)[index]
    recv = torch.empty(sum(recv_counts), width, dtype=torch.float32, device=device)
    if world == 1:
        recv.copy_(send)
    else:
        dist.all_to_all_single(recv, send.contiguous(), output_split_sizes=recv_counts, input_split_sizes=send_counts)
    return received, recv


def scatter_received(
    values_N: torch.Tensor,
    received: Sequence[int],
    counts: Sequence[int],
    rows: Sequence[int],
    T: int,
    starts: Sequence[int] | None = None,
) -> torch.Tensor:
    """What route_rows delivered -> dense rows [len(rows), T, ...] on the CPU, zero elsewhere: received row b's
    counts[b] values (route_rows' order, row after row) land at positions starts[b] .. starts[b] + counts[b] - 1
    (starts default 0) of row b's place among `rows`. Received rows not in `rows` are skipped."""
    values_N = values_N.cpu()
    where = {b: i for i, b in enumerate(rows)}
    out = torch.zeros((len(rows), T, *values_N.shape[1:]), dtype=values_N.dtype)
    src, dst_row, dst_t, o = [], [], [], 0
    for b in received:
        n = counts[b]
        if b in where and n:
            s = starts[b] if starts is not None else 0
            src.append(torch.arange(o, o + n))
            dst_row.append(torch.full((n,), where[b], dtype=torch.long))
            dst_t.append(torch.arange(s, s + n))
        o += n
    if src:
        out[torch.cat(dst_row), torch.cat(dst_t)] = values_N[torch.cat(src)]
    return out


def pack_columns(columns: Sequence[torch.Tensor]) -> torch.Tensor:
    """[N, c_i] float32 / int32 columns -> one [N, sum c_i] float32 payload (int32 reinterpreted bit for bit)."""
    parts = []
    for c in columns:
        if c.dtype == torch.int32:
            c = c.contiguous().view(torch.float32)
        elif c.dtype != torch.float32:
            raise TypeError(f"route_rows carries float32 and int32 columns, not {c.dtype}")
        parts.append(c.reshape(c.shape[0], -1))
    return torch.cat(parts, dim=1)


def unpack_columns(values_NC: torch.Tensor, widths: Sequence[int], dtypes: Sequence[torch.dtype]) -> list[torch.Tensor]:
    """The inverse of pack_columns: [N, c_i] tensors of the given widths and dtypes."""
    out, o = [], 0
    for w, dt in zip(widths, dtypes):
        c = values_NC[:, o : o + w].contiguous()
        out.append(c.view(torch.int32) if dt == torch.int32 else c)
        o += w
    return out
