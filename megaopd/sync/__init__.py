"""megaopd.sync: everything from the actor's shards to an engine's parameters.

    sync = WeightSync(engine if rank == 0 else None, cfg.rollout, rank)
    sync.push(actor_model, actor_hf_cfg, actor_pgs, weight_version=str(step))   # collective

Modules (one job each; the gather of this rank's shards into full HF-named tensors is
megaopd.models.gather, which the checkpoint converter uses too):
    in_process   transport "in_process": update_weights on an engine in this process
    distributed  transport "dist_group": SGLang's /update_weights_from_distributed over that group
    cuda_ipc     transport "cuda_ipc": SGLang's /update_weights_from_tensor with CUDA IPC handles
                 (colocated engines)
    http_lora    transport "http_lora": megaopd serve, the base as dist_group's, LoRA adapters alone through
                 POST /load_lora_adapter
    transport    TransportKind: what WeightSync knows of a transport (when it fits, who sends, its build)
    weight_sync  WeightSync: picks a transport per engine (engine.weight_transports + rollout.colocated)
                 from TRANSPORT_KINDS, the one list of transports, and orders memory resume around the push
What both ends of SGLang's update protocol share lives below this package, so that `megaopd serve`
(serving/) can speak it too: the bucket wire format in megaopd.rollout.weight_wire, the standalone
process group in megaopd.parallel.custom_group.
"""

from megaopd.sync.weight_sync import SyncStats, WeightSync, choose_transport

__all__ = ["WeightSync", "SyncStats", "choose_transport"]
