"""The job-size check of the model tools; running on ranks is megaopd.parallel.launch.run_on_ranks."""

from __future__ import annotations

import os

from megaopd.models.hf_config import InputError
from megaopd.parallel.launch import under_launcher


def check_world(model_parallel_size: int) -> None:
    """InputError when the launcher's world size cannot hold tp * pp ranks."""
    if under_launcher():
        world = int(os.environ["WORLD_SIZE"])
        if world % model_parallel_size:
            raise InputError(
                f"the job has {world} ranks, not a multiple of tp*pp = {model_parallel_size}; "
                "launch tp*pp (or a multiple) ranks"
            )
