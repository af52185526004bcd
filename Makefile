.PHONY: run test setup lint

run:     ## set up and run the main job on the embedded model
	scripts/run.sh

test:    ## set up and run lint and the whole test suite
	scripts/test.sh

setup:
	scripts/setup.sh test,parity

lint:
	.venv/bin/ruff check .
