# vision-attn: `make demo` sets up and runs the main job, `make test` sets up and runs the tests.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
FMNIST := /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz
RUNS   ?= runs

.PHONY: setup fashion-mnist demo test lint clean

setup: $(STAMP) fashion-mnist

# The venv, the pinned torch build this project is tested with, then the project (editable, with dev tools).
$(STAMP): pyproject.toml
	@$(PYTHON) -m venv $(VENV) 2>/dev/null || { apt-get update -qq && apt-get install -y -qq python3-venv && $(PYTHON) -m venv $(VENV); }
	$(BIN)/pip install -q torch==2.14.1 torchvision==0.29.1
	$(BIN)/pip install -q -e '.[dev]'
	@touch $(STAMP)

# Fashion-MNIST from Debian's package when it is missing and apt is there; otherwise the DataModule
# looks in its configured root and then tries torchvision's download.
fashion-mnist:
	@if [ ! -f $(FMNIST) ] && command -v apt-get >/dev/null 2>&1; then \
		echo "Installing Fashion-MNIST (dataset-fashion-mnist)"; \
		apt-get update -qq && apt-get install -y -qq dataset-fashion-mnist; \
	fi

# The main job on the embedded default: train the Fashion-MNIST ViT (<= 10 min on 2 cores), test it,
# and classify a few test images written as PNG files.
VIT_RUN := runs/vit_fashion_mnist
demo: setup
	$(BIN)/vision-attn fit --config configs/vit/fashion_mnist.yaml
	$(BIN)/vision-attn test --config configs/vit/fashion_mnist.yaml --ckpt_path $(VIT_RUN)/checkpoints/best.ckpt
	$(BIN)/vision-attn export-samples --dataset fashion-mnist --count 4 --out $(VIT_RUN)/samples
	$(BIN)/vision-attn classify --ckpt $(VIT_RUN)/checkpoints/best.ckpt $(VIT_RUN)/samples/*.png

# pytest exits 5 when it collected nothing: for this project that is a broken suite, so say so and fail.
test: setup
	@$(BIN)/python -m pytest -q $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests: the suite is broken"; exit 1; fi; exit $$rc

lint: setup
	$(BIN)/ruff check vision_attn tests scripts

clean:
	rm -rf $(VENV) $(RUNS) .pytest_cache
