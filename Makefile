# vision-attn: `make demo` sets up and runs the main job, `make test` sets up and runs the tests.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
FMNIST := /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz
RUNS   ?= runs

.PHONY: setup fashion-mnist chromium demo demo-vit test lint docs docs-serve clean

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

# The browser the explorer's tests drive (through Playwright, which cannot download its own here): Debian's.
chromium:
	@if [ ! -x /usr/bin/chromium ] && command -v apt-get >/dev/null 2>&1; then \
		echo "Installing chromium (for the attention explorer's browser tests)"; \
		apt-get update -qq && apt-get install -y -qq chromium; \
	fi

# The main job on the embedded default: pretrain the captioner's encoder on single Fashion-MNIST items drawn as
# the scenes draw them, over clutter (4 epochs), generate Fashion scenes and train the Show-Attend-Tell captioner
# from that encoder (560 steps; budgets in steps, the same run on every machine), test it on the default scenes
# (BLEU, METEOR, ROUGE-L,
# CIDEr-D, pointing, the scene metrics), score it again on scenes drawn another way (items anywhere, other shades of
# each colour, over photographs it never trained on), draw its attention over a handful of scenes of both kinds,
# and write the attention explorer of the test split's captions (a static site: open its index.html).
CPU      := --config configs/trainer/cpu.yaml
ITEMS    := $(CPU) --config configs/tasks/classifier.yaml --config configs/captioner/fashion_scene_items.yaml
CAPTION  := $(CPU) --config configs/tasks/captioner.yaml --config configs/captioner/fashion_scenes.yaml
VIT      := $(CPU) --config configs/tasks/classifier.yaml --config configs/data/fashion_mnist.yaml \
            --config configs/vit/fashion_mnist.yaml
CAP_RUN  := $(RUNS)/captioner_fashion_scenes
SCENES   := data/fashion_scenes_mixed_bright
HELD_OUT := data/fashion_scenes_held_out
# The captioner's final weights, where its cosine ends at max_steps (best.ckpt, the best by val CIDEr-D, is kept
# too).
CAP_CKPT := $(CAP_RUN)/checkpoints/last.ckpt
demo: setup
	$(BIN)/vision-attn fit $(ITEMS) --overwrite true
	$(BIN)/vision-attn fit $(CAPTION) --overwrite true
	$(BIN)/vision-attn test $(CAPTION) --ckpt_path $(CAP_CKPT)
	$(BIN)/vision-attn make-scenes --root $(HELD_OUT) --train 0 --val 0 --test 1000 --layout free --shade-jitter 1 \
		--background texture --texture-source matplotlib --background-level 0.25 --overwrite
	$(BIN)/vision-attn caption --ckpt $(CAP_CKPT) --coco-annotations $(HELD_OUT)/annotations/captions_test.json \
		--image-dir $(HELD_OUT)/images/test --out $(CAP_RUN)/results_held_out_test.json
	$(BIN)/vision-attn evaluate $(CAP_RUN)/results_held_out_test.json \
		--annotations $(HELD_OUT)/annotations/captions_test.json --instances $(HELD_OUT)/annotations/instances_test.json \
		--attributes $(HELD_OUT)/annotations/attributes_test.json --out $(CAP_RUN)/scores_held_out_test.json
	$(BIN)/vision-attn overlay --ckpt $(CAP_CKPT) --out $(CAP_RUN)/overlays --overwrite \
		$(SCENES)/images/test/1.png $(SCENES)/images/test/2.png $(SCENES)/images/test/3.png \
		$(HELD_OUT)/images/test/1.png $(HELD_OUT)/images/test/2.png $(HELD_OUT)/images/test/3.png
	@echo "Attention overlays: $(CAP_RUN)/overlays/*.png, gallery $(CAP_RUN)/overlays/index.html"
	$(BIN)/vision-attn explore $(CAP_RUN)/results_test.json --instances $(SCENES)/annotations/instances_test.json \
		--attributes $(SCENES)/annotations/attributes_test.json --out $(CAP_RUN)/explorer --overwrite
	@echo "Attention explorer: open $(CURDIR)/$(CAP_RUN)/explorer/index.html (or: python3 -m http.server -d $(CAP_RUN)/explorer)"

# The ViT on Fashion-MNIST (20 epochs), its test accuracy, top-5 classes of a few test images, and its
# rollout overlays on those images and on garments placed at random on a larger canvas.
VIT_RUN := $(RUNS)/vit_fashion_mnist
demo-vit: setup
	$(BIN)/vision-attn fit $(VIT) --overwrite true
	$(BIN)/vision-attn test $(VIT) --ckpt_path $(VIT_RUN)/checkpoints/last.ckpt
	$(BIN)/vision-attn export-samples --dataset fashion-mnist --count 4 --out $(VIT_RUN)/samples --overwrite
	$(BIN)/vision-attn export-samples --dataset fashion-mnist --count 4 --canvas-size 56 \
		--out $(VIT_RUN)/samples_canvas --overwrite
	$(BIN)/vision-attn classify --ckpt $(VIT_RUN)/checkpoints/last.ckpt $(VIT_RUN)/samples/*.png \
		$(VIT_RUN)/samples_canvas/*.png
	$(BIN)/vision-attn overlay --ckpt $(VIT_RUN)/checkpoints/last.ckpt --out $(VIT_RUN)/overlays --overwrite \
		$(VIT_RUN)/samples $(VIT_RUN)/samples_canvas
	@echo "Attention overlays: $(VIT_RUN)/overlays/*.png, gallery $(VIT_RUN)/overlays/index.html"

# pytest exits 5 when it collected nothing: for this project that is a broken suite, so say so and fail.
# The tests run on every core (pytest-xdist), one torch thread each: much of the suite waits on subprocesses,
# Java (METEOR) and files, so two one-thread workers on 2 cores finish in ~2/3 of the serial time. The heavy tests
# come first (tests/conftest.py) and are handed out two at a time, so both workers share them. The slowest 25
# are listed at the end, to keep the suite's time in view.
test: setup chromium
	@OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -n auto --dist load --maxschedchunk 2 --durations 25 \
		$(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests: the suite is broken"; exit 1; fi; exit $$rc

# The documentation site (MkDocs, Material, mkdocstrings), built into site/ with warnings as errors.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

docs-serve: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs serve -a 127.0.0.1:8000

lint: setup
	$(BIN)/ruff check vision_attn tests scripts benchmarks

clean:
	rm -rf $(VENV) $(RUNS) .pytest_cache site
