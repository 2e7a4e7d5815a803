"""The ``vision-attn`` command, which only wires: fit/validate/test/predict are LightningCLI (``trainer_cli.py``), every
other tool a function of ``vision_attn.commands``. Nothing heavy is imported before a command needs it, so ``--help``
is instant and the inference tools never import Lightning."""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence
from contextlib import redirect_stdout

from vision_attn.commands import TOOLS, data, inference, interventions  # noqa: F401 - importing them registers their tools
from vision_attn.errors import EscapedFormatter, EscapedOutput, exit_on_user_error

LIGHTNING_COMMANDS = {"fit": "train a model (--config configs/...yaml)", "validate": "run the validation loop",
                      "test": "run the test loop (--ckpt_path C)",
                      "predict": "predict the test split, as JSON in the run's folder (--ckpt_path C)"}


def main(args: Sequence[str] | None = None) -> None:
    """Console-script entry point; ``args`` replaces ``sys.argv[1:]`` when called from Python."""
    argv = list(sys.argv[1:] if args is None else args)
    if not logging.getLogger().handlers:  # logging.basicConfig's handler, with its lines shown escaped
        handler = logging.StreamHandler()
        handler.setFormatter(EscapedFormatter("%(levelname)s %(name)s: %(message)s"))
        logging.basicConfig(level=logging.INFO, handlers=[handler])
    if not argv or argv[0] in ("-h", "--help"):  # every command with its one-line summary
        print("usage: vision-attn COMMAND [options]\n\ncommands:")
        for name, text in {**LIGHTNING_COMMANDS, **{k: v[1] for k, v in TOOLS.items()}}.items():
            print(f"  {name:<15} {text}")
        print("\n`vision-attn COMMAND --help` shows a command's options.")
        return
    with exit_on_user_error():
        if argv[0] in TOOLS:  # what a tool prints names the user's files: shown escaped (``errors.printable``)
            with redirect_stdout(EscapedOutput(sys.stdout)):
                TOOLS[argv[0]][0](argv[1:])
        else:
            from vision_attn.trainer_cli import run_lightning
            run_lightning(argv if args is not None else None)


if __name__ == "__main__":
    main()
