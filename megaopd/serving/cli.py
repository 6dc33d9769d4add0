"""`megaopd serve`: the embedded engine behind the subset of SGLang's native HTTP API that megaopd uses.

    megaopd serve --hf-dir DIR --port 30000 [--host 127.0.0.1] [--max-batch-size 64] [--sglang-version 0.5.23]
    MEGAOPD_API_KEY=$(openssl rand -hex 32) megaopd serve --hf-dir DIR --host 0.0.0.0 --allowed-sync-host node0

The server answers GET /health with 503 while the model loads, then serves until SIGTERM or Ctrl-C
(megaopd.serving.server lists the endpoints). With a key (MEGAOPD_API_KEY, or --api-key, which other
users of the machine can read in the process list) every endpoint but /health* needs
`Authorization: Bearer <key>`; without one only loopback may be bound. docs/engines.md "Running megaopd
serve safely" has the rest.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading

import torch

from megaopd.serving.access import API_KEY_ENV
from megaopd.serving.server import RolloutServer, ServeConfig


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="megaopd serve", description=__doc__.split("\n\n")[0])
    ap.add_argument("--hf-dir", required=True, help="HF model directory (config.json + safetensors)")
    ap.add_argument("--port", type=int, default=30000)
    ap.add_argument("--host", default="127.0.0.1", help="interface to bind (default 127.0.0.1: loopback only)")
    ap.add_argument("--max-batch-size", type=int, default=64)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--release-weights", default="auto", choices=["auto", "keep", "offload", "discard"])
    ap.add_argument(
        "--sglang-version",
        default="0.5.23",
        help="SGLang version whose weight-update protocol to speak (>= 0.5.20: begin/end sessions)",
    )
    ap.add_argument("--num-threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--log-level", default="INFO")
    ap.add_argument(
        "--api-key",
        default=None,
        help=f"key every request but /health* must send as `Authorization: Bearer KEY` (SGLang's flag; "
        f"default: ${API_KEY_ENV}, which keeps it out of the process list). Needed to bind "
        "anything but loopback",
    )
    ap.add_argument("--max-body-mb", type=float, default=64.0, help="largest request body in MiB (HTTP 413 above)")
    ap.add_argument(
        "--socket-timeout-s", type=float, default=60.0, help="longest wait on one socket read or write of a request"
    )
    ap.add_argument("--listen-backlog", type=int, default=1024, help="connections queued before they are accepted")
    ap.add_argument(
        "--allowed-weight-root",
        action="append",
        default=[],
        metavar="DIR",
        help="a folder /update_weights_from_disk may read, besides --hf-dir (repeatable)",
    )
    ap.add_argument(
        "--allowed-sync-host",
        action="append",
        default=[],
        metavar="HOST",
        help="a host /init_weights_update_group may connect to besides loopback: the trainer's rank 0 "
        "(rollout.weight_sync_address; repeatable)",
    )
    args = ap.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    try:  # bad settings: one line, before the model loads
        config = ServeConfig(
            hf_dir=args.hf_dir,
            port=args.port,
            host=args.host,
            max_batch_size=args.max_batch_size,
            device=args.device,
            dtype=args.dtype,
            release_weights=args.release_weights,
            sglang_version=args.sglang_version,
            api_key=args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV) or None,
            max_body_bytes=int(args.max_body_mb * (1 << 20)),
            socket_timeout_s=args.socket_timeout_s,
            listen_backlog=args.listen_backlog,
            allowed_weight_roots=args.allowed_weight_root,
            allowed_sync_hosts=args.allowed_sync_host,
        )
        server = RolloutServer(config)
    except (ValueError, OSError) as e:
        print(f"megaopd serve: {e}", file=sys.stderr, flush=True)
        return 2
    # SIGTERM (the launcher's stop) ends serve_forever like Ctrl-C does.
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    http = threading.Thread(target=server.serve_forever, name="megaopd-serve-http", daemon=True)
    http.start()  # answer /health with 503 while the model loads
    try:
        server.load_engine()
    except Exception:  # noqa: BLE001 - already logged
        server.shutdown()
        return 1
    print(
        f"megaopd serve: {config.hf_dir} on {server.url} "
        f"({'API key required' if config.api_key else 'no API key: loopback only'})",
        file=sys.stderr,
        flush=True,
    )
    try:
        while http.is_alive():
            http.join(timeout=1.0)
    except KeyboardInterrupt:
        pass
    finally:
        server.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
