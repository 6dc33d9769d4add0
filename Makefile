.PHONY: install test test-quick

install:
	bash scripts/install.sh

# Installs what is missing and runs every test (CI runs exactly this).
test:
	bash scripts/test.sh

test-quick:
	python3 -m pytest -q -m "not slow"
