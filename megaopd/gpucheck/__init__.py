"""The GPU bring-up check (run by scripts/gpu_check.sh / `make gpu-check`).

    python -m megaopd.gpucheck                 # parts a-d on the GPU, table to stdout (and $OUT/gpu_check.md)
    python -m megaopd.gpucheck --parts c       # one part
    python -m megaopd.gpucheck --bench         # the measurements (loss, engine, trainer)
    python -m megaopd.gpucheck --quick         # CPU smoke mode: tiny shapes, float32, gloo

Modules: report (the table), build (random Qwen2.5-shaped HF models, extended tiny tokenizer), ops_check (a),
models_check (b), trainer_check (c), tp_check (d), bench. Exit status 1 when any row FAILs.
"""
