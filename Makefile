.PHONY: run test test-fast setup lint

run:     ## set up and run the main job on the embedded model
	scripts/run.sh

test:    ## set up and run lint and the whole test suite
	scripts/test.sh

test-fast:  ## set up and run lint and the fast tier (tests/fast_tier.txt)
	scripts/test.sh -m fast --durations=10

setup:
	scripts/setup.sh test,parity,tasks

lint:
	.venv/bin/ruff check .
