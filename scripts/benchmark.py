"""Run the benchmark: the same as `vision-attn benchmark` (see vision_attn/benchmark.py)."""

from vision_attn.benchmark import main

if __name__ == "__main__":
    main()
