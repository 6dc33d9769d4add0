.PHONY: install test test-quick demo gpu-check

install:
	bash scripts/install.sh

# Installs what is missing and runs every test (CI runs exactly this).
test:
	bash scripts/test.sh

test-quick:
	python3 -m pytest -q -m "not slow"

# The embedded default: Stable-OPD of the tiny student from the tiny teacher, CPU, student TP=2 on 2 gloo
# workers, a few minutes (examples/tiny/README.md). Prints validation accuracy before -> after. Each call
# is a fresh run folder (runs/tiny/demo_DATE_TIME): the preset's own folder would resume a finished run.
demo:
	@python3 -c "import megaopd, megatron.core, transformers" 2>/dev/null || bash scripts/install.sh
	megaopd train examples/tiny/stable_opd.yaml run.dir=runs/tiny/demo_$$(date +%Y%m%d_%H%M%S)

# Issue 13's GPU bring-up check on one GPU (scripts/gpu_check.sh: the table, the parts, how to run it on the
# lent machine). `make gpu-check ARGS=--quick` is the CPU smoke mode.
gpu-check:
	bash scripts/gpu_check.sh $(ARGS)
