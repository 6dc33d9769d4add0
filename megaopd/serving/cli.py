"""`megaopd serve`: the embedded engine behind the subset of SGLang's native HTTP API that megaopd uses.

    megaopd serve --hf-dir DIR --port 30000 [--host 127.0.0.1] [--max-batch-size 64] [--sglang-version 0.5.23]

The server answers GET /health with 503 while the model loads, then serves until SIGTERM or Ctrl-C
(megaopd.serving.server lists the endpoints).
"""
from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading

import torch

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
    ap.add_argument("--sglang-version", default="0.5.23",
                    help="SGLang version whose weight-update protocol to speak (>= 0.5.20: begin/end sessions)")
    ap.add_argument("--num-threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--log-level", default="INFO")
    args = ap.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    config = ServeConfig(hf_dir=args.hf_dir, port=args.port, host=args.host, max_batch_size=args.max_batch_size,
                         device=args.device, dtype=args.dtype, release_weights=args.release_weights,
                         sglang_version=args.sglang_version)
    server = RolloutServer(config)
    # SIGTERM (the launcher's stop) ends serve_forever like Ctrl-C does.
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    http = threading.Thread(target=server.serve_forever, name="megaopd-serve-http", daemon=True)
    http.start()  # answer /health with 503 while the model loads
    try:
        server.load_engine()
    except Exception:  # noqa: BLE001 - already logged
        server.shutdown()
        return 1
    print(f"megaopd serve: {config.hf_dir} on {server.url}", file=sys.stderr, flush=True)
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
